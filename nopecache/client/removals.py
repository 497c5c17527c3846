"""Following the servers' removal feeds (WatchRemovals): which stored keys left the cache.

An engine that announces what it stored (vLLM's KV events) needs to hear when a server
drops, deletes or flushes those blocks, whichever client caused it. A
:class:`RemovalFollower` keeps one ``WatchRemovals`` stream open per server, each in a
daemon thread with a synchronous gRPC channel of its own (the client's TLS settings and
token), and hands every event to ``on_removal(server, removal)``::

    server A ──WatchRemovals──> thread A ─┐
    server B ──WatchRemovals──> thread B ─┴─> on_removal(address, Removal)

A stream that breaks (server restarted, network) is opened again after ``retry_s``; what
happened while it was down is unknown, so the follower reports ``Removal(lost=True)`` for
that server first (the caller withdraws what it announced there). ``on_removal`` runs on
the follower's threads: it must be thread-safe and quick.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from nopecache.client.config import ClientConfig
from nopecache.client.transport import channel_credentials
from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from nopecache.proto.block import KEY_BYTES

__all__ = ["Removal", "RemovalFollower"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Removal:
    """One event: client keys gone, the namespace cleared, or possibly missed events."""

    keys: tuple[bytes, ...] = ()
    cleared: bool = False
    lost: bool = False

    @classmethod
    def of(cls, event: pb.RemovalEvent) -> Removal:
        """The event as sent (keys unpacked)."""
        packed = event.keys
        keys = tuple(packed[i : i + KEY_BYTES] for i in range(0, len(packed), KEY_BYTES))
        return cls(keys, event.cleared, event.lost)


RemovalHandler = Callable[[str, Removal], None]


class RemovalFollower:
    """One WatchRemovals stream per server, each followed by a thread (module docstring)."""

    def __init__(
        self,
        config: ClientConfig,
        on_removal: RemovalHandler,
        *,
        servers: Sequence[str] | None = None,
        retry_s: float = 1.0,
    ) -> None:
        """Follow ``servers`` (default: the config's); call :meth:`start` to begin."""
        self._config = config
        self._servers = tuple(config.servers if servers is None else servers)
        self._on_removal = on_removal
        self._retry_s = retry_s
        self._stop = threading.Event()
        self._open = {address: threading.Event() for address in self._servers}
        self._calls: dict[str, grpc.Call] = {}
        self._lock = threading.Lock()  # guards _calls
        self._threads = [
            threading.Thread(
                target=self._follow, args=(address,), name=f"nopecache-removals-{address}"
            )
            for address in self._servers
        ]
        for thread in self._threads:
            thread.daemon = True
        self._metadata = (("authorization", f"Bearer {config.token}"),) if config.token else ()
        self._credentials = channel_credentials(config) if config.use_tls else None

    def start(self) -> RemovalFollower:
        """Open the streams (in the background)."""
        for thread in self._threads:
            thread.start()
        return self

    def wait_open(self, timeout_s: float) -> bool:
        """Whether every stream was opened (its first, empty event came) within the bound."""
        return all(event.wait(timeout_s) for event in self._open.values())

    def close(self) -> None:
        """Cancel the streams and wait for the threads."""
        self._stop.set()
        with self._lock:
            for call in self._calls.values():
                call.cancel()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=10)

    def _channel(self, address: str) -> grpc.Channel:
        options = self._config.channel_options()
        if self._credentials is not None:
            return grpc.secure_channel(address, self._credentials, options=options)
        return grpc.insecure_channel(address, options=options)

    def _follow(self, address: str) -> None:
        broken = False
        while not self._stop.is_set():
            with self._channel(address) as channel:
                stub = cache_pb2_grpc.KVCacheStub(channel)
                call = stub.WatchRemovals(pb.WatchRemovalsRequest(), metadata=self._metadata)
                with self._lock:
                    self._calls[address] = call
                if self._stop.is_set():
                    call.cancel()
                try:
                    for n, event in enumerate(call):
                        if n == 0:  # the opening event: nothing missed from here on
                            if broken:
                                self._on_removal(address, Removal(lost=True))
                            self._open[address].set()
                            continue
                        self._on_removal(address, Removal.of(event))
                except grpc.RpcError as err:
                    if not self._stop.is_set():
                        log.info("nopecache: removal feed of %s broke (%s)", address, err.code())
                finally:
                    with self._lock:
                        self._calls.pop(address, None)
            broken = True
            self._stop.wait(self._retry_s)
