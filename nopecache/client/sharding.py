"""Which server owns a key: rendezvous (highest random weight) hashing.

Every (server, key) pair gets a pseudo-random 64-bit weight and a key belongs to the
server of highest weight::

    seed(server)      = xxh3_64(server id as UTF-8)                  once per server
    weight(server, k) = xxh3_64(key bytes, seed=seed(server))        unsigned 64-bit
    owner(k)          = argmax over servers of weight(server, k)
                        (ties, at odds of 2**-64, go to the smallest server id)

A key's weights do not depend on which other servers exist, so membership changes move
the fewest keys possible: a server added takes the keys where it now weighs most (about
1/n of them) and nothing else moves; a server removed gives up only its own keys, each to
the runner-up of that key. No ring, no virtual nodes, and the same answer in every
process and language that has xxh3 (never Python's ``hash``, which is salted per process).

``ranked(key)`` lists all servers by decreasing weight: the fallback order if the owner
is down. Server ids are the ``host:port`` strings of the config; two clients agree on
owners exactly when they list the same ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import repeat

import numpy as np
import xxhash

from nopecache.client.errors import InvalidArgumentError
from nopecache.client.keys import BlockKey

__all__ = ["KeyLike", "Rendezvous", "server_seed", "weight"]

KeyLike = BlockKey | bytes

_hash = xxhash.xxh3_64_intdigest


def server_seed(server: str) -> int:
    """The xxh3 seed derived from a server id."""
    return _hash(server.encode("utf-8"))


def weight(server: str, key: KeyLike) -> int:
    """The rendezvous weight of ``key`` on ``server`` (an unsigned 64-bit int)."""
    return _hash(_key_bytes(key), server_seed(server))


def _key_bytes(key: object) -> bytes:
    if isinstance(key, BlockKey):
        return key.value
    if isinstance(key, bytes):
        return key
    raise InvalidArgumentError("key", f"must be a BlockKey or bytes, got {type(key).__name__}")


class Rendezvous:
    """An immutable assignment of keys to servers by highest random weight."""

    __slots__ = ("_seeds", "_servers")

    def __init__(self, servers: Iterable[str]) -> None:
        """Shard over ``servers`` (distinct, non-empty ids; their order does not matter)."""
        if isinstance(servers, str):
            raise InvalidArgumentError("servers", "must be a sequence of ids, not one str")
        ids = list(servers)
        for server in ids:
            if not isinstance(server, str) or not server:
                raise InvalidArgumentError(
                    "servers", f"a server id must be a non-empty str, got {server!r}"
                )
        if not ids:
            raise InvalidArgumentError("servers", "at least one server is required")
        if len(set(ids)) != len(ids):
            twice = sorted({s for s in ids if ids.count(s) > 1})
            raise InvalidArgumentError("servers", f"listed more than once: {twice}")
        # Sorted so ties and group order do not depend on the order the caller listed.
        self._servers: tuple[str, ...] = tuple(sorted(ids))
        self._seeds: tuple[int, ...] = tuple(server_seed(s) for s in self._servers)

    @property
    def servers(self) -> tuple[str, ...]:
        """The server ids, sorted."""
        return self._servers

    def __len__(self) -> int:
        return len(self._servers)

    def __repr__(self) -> str:
        return f"Rendezvous({list(self._servers)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Rendezvous) and other._servers == self._servers

    def __hash__(self) -> int:
        return hash(self._servers)

    def owner(self, key: KeyLike) -> str:
        """The server that owns ``key``."""
        data = _key_bytes(key)
        best, best_weight = 0, -1
        for i, seed in enumerate(self._seeds):
            w = _hash(data, seed)
            if w > best_weight:  # strict: the first (smallest) id wins a tie
                best, best_weight = i, w
        return self._servers[best]

    def ranked(self, key: KeyLike) -> list[str]:
        """All servers, owner first, then by decreasing weight (the fallback order)."""
        data = _key_bytes(key)
        order = sorted(range(len(self._servers)), key=lambda i: (-_hash(data, self._seeds[i]), i))
        return [self._servers[i] for i in order]

    def group(self, keys: Sequence[KeyLike]) -> dict[str, list[int]]:
        """Indices of ``keys`` per owning server, ascending; servers owning none are absent.

        The dict is ordered by server id. One xxh3 per (server, key) pair through
        ``map`` (the C loop, no Python frame per pair), then one numpy argmax.
        """
        datas = [_key_bytes(k) for k in keys]
        if not datas:
            return {}
        if len(self._servers) == 1:
            return {self._servers[0]: list(range(len(datas)))}
        weights = np.array(
            [list(map(_hash, datas, repeat(seed))) for seed in self._seeds], dtype=np.uint64
        )
        owners = weights.argmax(axis=0)  # first maximum: same tie rule as owner()
        out: dict[str, list[int]] = {}
        for i, server in enumerate(self._servers):
            idx = np.flatnonzero(owners == i)
            if idx.size:
                out[server] = idx.tolist()
        return out

    def with_servers(self, servers: Iterable[str]) -> Rendezvous:
        """A new assignment over ``servers`` (this one is unchanged)."""
        return Rendezvous(servers)
