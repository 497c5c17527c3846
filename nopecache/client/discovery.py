"""Service discovery: the servers a client shards over follow what DNS names resolve to.

With ``discover=dns`` (see ``config.py``) every configured server entry ``name:port`` is a
name standing for all of its addresses. A Kubernetes headless Service has one A/AAAA
record per ready replica::

    nopecache-headless.ns.svc.cluster.local:50551
        -> 10.1.0.7:50551  10.1.3.2:50551  10.1.4.9:50551        the ring (sorted union)

:class:`Discovery` resolves every name without blocking the loop, takes the union, and
hands a changed set to the client (``AsyncCacheClient.set_servers``): with rendezvous
hashing only the keys of servers that came or went move. It resolves again

    * every ``dns_refresh_s`` (0: never on a timer),
    * soon after :meth:`Discovery.server_failed` (the client calls it when a server stops
      answering, so a replica that died leaves the ring as soon as DNS stops listing it),
    * but never sooner than ``dns_min_interval_s`` after the previous resolution, so a
      replica that stays listed while dead does not turn every call into a DNS query.

A name that fails to resolve (or takes longer than the client's ``connect_timeout_s``),
or resolves to nothing, keeps the addresses it had: a DNS blip must not empty the ring.
Until some name has resolved once, the ring is the configured entries themselves.

Identity: ring ids are the resolved ``ip:port``. A replica restarted with a new IP is a
new member (its keys move; with a shared Redis they are still found there). A single
StatefulSet pod name given without ``discover=dns`` keeps its name as its id instead.

Resolvers are injectable (:class:`Resolver`). The default, :class:`GetaddrinfoResolver`,
answers every address of the name with the entry's port; another may answer ``host:port``
pairs with ports of their own, as SRV records would (several servers on one address).

Concurrency: everything runs on the client's event loop. One background task does the
timed and failure-triggered resolutions; :meth:`Discovery.refresh` may also be awaited
directly. An ``asyncio.Lock`` (never held by a blocking call) serialises resolutions, so
an older answer can never be applied after a newer one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from nopecache.client.config import ClientConfig, DnsFamily, normalize_server, split_server
from nopecache.client.errors import InvalidArgumentError

__all__ = ["ApplyServers", "Discovery", "GetaddrinfoResolver", "Resolver"]

log = logging.getLogger(__name__)

ApplyServers = Callable[[tuple[str, ...]], Awaitable[None]]
"""Called with the new sorted server set whenever it changes (``set_servers``)."""

_FAMILIES = {"any": socket.AF_UNSPEC, "ipv4": socket.AF_INET, "ipv6": socket.AF_INET6}


class Resolver(Protocol):
    """Turns one configured name into the ``host:port`` addresses of the servers behind it."""

    async def resolve(self, host: str, port: int) -> Sequence[str]:
        """The addresses of ``host`` (``port`` is the entry's); OSError if it does not resolve."""
        ...


@dataclass(frozen=True, slots=True)
class GetaddrinfoResolver:
    """The default resolver: every A (and/or AAAA) address of a name, with the entry's port.

    Uses ``loop.getaddrinfo`` (the system resolver on the loop's executor, so the loop never
    blocks): /etc/hosts, cluster DNS search domains and IP literals all work as for any
    program on the machine.
    """

    family: DnsFamily = "any"

    def __post_init__(self) -> None:
        if self.family not in _FAMILIES:
            raise InvalidArgumentError(
                "family", f"must be one of {tuple(_FAMILIES)}, got {self.family!r}"
            )

    async def resolve(self, host: str, port: int) -> tuple[str, ...]:
        """Every distinct address of ``host`` as ``ip:port`` / ``[ipv6]:port``, in DNS order."""
        infos = await asyncio.get_running_loop().getaddrinfo(
            host,
            port,
            family=_FAMILIES[self.family],
            type=socket.SOCK_STREAM,
            proto=socket.IPPROTO_TCP,
        )
        out: dict[str, None] = {}
        for family, _, _, _, sockaddr in infos:
            ip = str(sockaddr[0])
            if family == socket.AF_INET6:
                out[f"[{ip}]:{port}"] = None
            elif family == socket.AF_INET:
                out[f"{ip}:{port}"] = None
        return tuple(out)


class Discovery:
    """Keeps a client's server set equal to the union of what its names resolve to."""

    def __init__(
        self,
        names: Sequence[str],
        apply: ApplyServers,
        *,
        resolver: Resolver | None = None,
        refresh_s: float = 30.0,
        min_interval_s: float = 1.0,
        timeout_s: float = 1.0,
    ) -> None:
        """Discovery of ``names`` (``host:port`` entries); ``apply`` receives each new set.

        ``timeout_s`` bounds one resolution; a name that takes longer keeps its addresses.
        """
        if isinstance(names, str) or not names:
            raise InvalidArgumentError("names", f"must be a non-empty sequence, got {names!r}")
        self._names = tuple(dict.fromkeys(split_server(n) for n in names))
        for name, value in (
            ("refresh_s", refresh_s),
            ("min_interval_s", min_interval_s),
            ("timeout_s", timeout_s),
        ):
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise InvalidArgumentError(name, f"must be a finite number >= 0, got {value!r}")
        if timeout_s <= 0:
            raise InvalidArgumentError("timeout_s", f"must be > 0, got {timeout_s}")
        self._apply = apply
        self._resolver: Resolver = GetaddrinfoResolver() if resolver is None else resolver
        self.refresh_s = float(refresh_s)
        self.min_interval_s = float(min_interval_s)
        self.timeout_s = float(timeout_s)
        self._servers = tuple(sorted(normalize_server(n) for n in names))
        # The last non-empty answer of each name (a failed resolution keeps it).
        self._answers: dict[tuple[str, int], tuple[str, ...]] = {}
        self._last = -math.inf  # time.monotonic() of the last resolution
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._first: asyncio.Task[tuple[str, ...]] | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @classmethod
    def for_config(
        cls, config: ClientConfig, apply: ApplyServers, resolver: Resolver | None = None
    ) -> Discovery:
        """The discovery a config with ``discover=dns`` asks for (its names and timings)."""
        if config.discover != "dns":
            raise InvalidArgumentError(
                "discover", f"discovery needs discover='dns', the config has {config.discover!r}"
            )
        return cls(
            config.servers,
            apply,
            resolver=GetaddrinfoResolver(config.dns_family) if resolver is None else resolver,
            refresh_s=config.dns_refresh_s,
            min_interval_s=config.dns_min_interval_s,
            timeout_s=config.connect_timeout_s,
        )

    @property
    def servers(self) -> tuple[str, ...]:
        """The server set last applied (the configured names before any resolution)."""
        return self._servers

    @property
    def started(self) -> bool:
        """Whether :meth:`start` has been called."""
        return self._first is not None

    async def start(self) -> tuple[str, ...]:
        """Resolve for the first time, then keep resolving in the background; the servers.

        Idempotent and cheap once done: the client awaits it before every lookup, and
        concurrent first callers all wait for the same first resolution.
        """
        if self._closed:
            return self._servers
        if self._first is None:
            self._first = asyncio.get_running_loop().create_task(self._begin())
        return await asyncio.shield(self._first)

    async def _begin(self) -> tuple[str, ...]:
        servers = await self.refresh()
        if not self._closed:
            self._task = asyncio.get_running_loop().create_task(self._run())
        return servers

    def server_failed(self) -> None:
        """Ask for a resolution soon (at most one per ``min_interval_s``); never blocks."""
        self._wake.set()

    async def refresh(self) -> tuple[str, ...]:
        """Resolve every name now and apply the union if it changed; the servers after it."""
        async with self._lock:
            self._last = time.monotonic()
            answers = await asyncio.gather(*(self._resolve(h, p) for h, p in self._names))
            for name, answer in zip(self._names, answers, strict=True):
                if answer:
                    self._answers[name] = answer
            union = sorted({a for answer in self._answers.values() for a in answer})
            servers = tuple(union)
            if servers and servers != self._servers and not self._closed:
                added = sorted(set(servers) - set(self._servers))
                removed = sorted(set(self._servers) - set(servers))
                log.info("nopecache discovery: servers %s added, %s removed", added, removed)
                await self._apply(servers)
                self._servers = servers
        return self._servers

    async def _resolve(self, host: str, port: int) -> tuple[str, ...]:
        """One name's normalized addresses; () when it does not resolve (logged)."""
        try:
            async with asyncio.timeout(self.timeout_s):
                answer = await self._resolver.resolve(host, port)
        except OSError as e:  # socket.gaierror, or TimeoutError: no answer this time
            log.warning("nopecache discovery: %s:%d did not resolve (%s)", host, port, e)
            return ()
        out: dict[str, None] = {}
        for address in answer:
            try:
                out[normalize_server(address, default_port=port)] = None
            except InvalidArgumentError as e:
                log.warning("nopecache discovery: %s:%d gave a bad address: %s", host, port, e)
        if not out:
            log.warning("nopecache discovery: %s:%d resolved to no address", host, port)
        return tuple(out)

    async def _run(self) -> None:
        """The background task: resolve on the timer or on a failure, rate-limited."""
        while not self._closed:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.refresh_s or None):
                    await self._wake.wait()
            # Failures right after a resolution wait out the rest of the interval; those
            # reported meanwhile are answered by the same resolution.
            delay = self._last + self.min_interval_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            self._wake.clear()
            try:
                await self.refresh()
            except Exception:  # a background task has no caller to raise to
                log.exception("nopecache discovery: applying the resolved servers failed")

    async def close(self) -> None:
        """Stop resolving (the background task is cancelled and awaited)."""
        self._closed = True
        tasks: list[asyncio.Task[Any]] = [t for t in (self._first, self._task) if t is not None]
        for task in tasks:
            task.cancel()
        # A first resolution that failed already raised to whoever awaited start().
        await asyncio.gather(*tasks, return_exceptions=True)
