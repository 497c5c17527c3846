"""The hand-off a prefill engine gives the decode engine, as vLLM's ``kv_transfer_params``.

``{"nopecache": {"v": 1, "blocks": n, "block_size": bs, "digest": "<32 hex>"}}``: the
producer stored the prompt's first ``n`` whole blocks (``n * bs`` tokens: the ones a decode
engine claims, every whole block before the prompt's last token), and ``digest`` is
blake2b-128 over their cache keys in order. The consumer computes the keys of its own
prompt's first ``n`` blocks and compares: the keys fold in the model fingerprint, the
namespace and the request identity, so a digest that differs means another model, tenant,
adapter or prompt (a proxy bug), and the params are not waited on. Keys, not vLLM block
hashes: the two engines' hashes are salted per process unless PYTHONHASHSEED is pinned.

An optional ``"deadline_ms": m`` (a positive int, added by whoever forwards the params: a
proxy with a latency budget, a client) shortens the consumer's wait for this request to
``min(handoff_deadline_ms, m)``; it never lengthens it past the engine's setting.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PARAMS_KEY", "HandOff", "keys_digest"]

PARAMS_KEY = "nopecache"
"""The key of the hand-off inside ``kv_transfer_params`` (other connectors' keys pass by)."""
_VERSION = 1


def keys_digest(keys: Sequence[bytes]) -> str:
    """blake2b-128 over the concatenated keys, in hex."""
    return hashlib.blake2b(b"".join(keys), digest_size=16).hexdigest()


@dataclass(frozen=True, slots=True)
class HandOff:
    """The first ``blocks`` whole blocks of a prompt, stored by a producer."""

    blocks: int
    block_size: int
    digest: str
    deadline_ms: int | None = None  # this request's wait, if shorter than the engine's

    def __post_init__(self) -> None:
        if self.blocks < 1 or self.block_size < 1:
            raise ValueError(f"a hand-off names >= 1 blocks of >= 1 tokens, got {self}")
        if self.deadline_ms is not None and self.deadline_ms < 1:
            raise ValueError(f"deadline_ms must be >= 1, got {self.deadline_ms}")
        if len(self.digest) != 32 or any(c not in "0123456789abcdef" for c in self.digest):
            raise ValueError(f"digest must be 32 lowercase hex digits, got {self.digest!r}")

    @property
    def tokens(self) -> int:
        """Prompt tokens the named blocks cover."""
        return self.blocks * self.block_size

    def wait_ms(self, engine_ms: float) -> float:
        """How long the consumer waits for the blocks: the engine's ``handoff_deadline_ms``,
        or this hand-off's ``deadline_ms`` where that is shorter."""
        return engine_ms if self.deadline_ms is None else min(engine_ms, self.deadline_ms)

    def to_params(self) -> dict[str, Any]:
        """As ``kv_transfer_params`` (JSON-able)."""
        body: dict[str, Any] = {
            "v": _VERSION,
            "blocks": self.blocks,
            "block_size": self.block_size,
            "digest": self.digest,
        }
        if self.deadline_ms is not None:
            body["deadline_ms"] = self.deadline_ms
        return {PARAMS_KEY: body}

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> HandOff | str | None:
        """The hand-off in ``params``; None when they hold none (a plain request); a
        string saying what is wrong when they hold a malformed one."""
        if not params or PARAMS_KEY not in params:
            return None
        body = params[PARAMS_KEY]
        if not isinstance(body, Mapping) or body.get("v") != _VERSION:
            return f"{PARAMS_KEY!r} is not a version {_VERSION} hand-off: {body!r}"
        blocks, size, digest = body.get("blocks"), body.get("block_size"), body.get("digest")
        deadline = body.get("deadline_ms")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (blocks, size)):
            return f"blocks and block_size must be ints: {body!r}"
        if not isinstance(digest, str):
            return f"digest must be a string: {body!r}"
        if deadline is not None and (not isinstance(deadline, int) or isinstance(deadline, bool)):
            return f"deadline_ms must be an int: {body!r}"
        try:
            return cls(blocks, size, digest, deadline)  # type: ignore[arg-type]  # checked above
        except ValueError as err:
            return str(err)
