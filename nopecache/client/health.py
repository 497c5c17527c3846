"""One server's health as the client sees it: up, down for a back-off, refusing our
credentials, or busy; failures are logged once per outage and counted.

Failures of a call and what they mean::

    INVALID_ARGUMENT                     this request was bad: logged, the server stays up
    RESOURCE_EXHAUSTED                   busy (max_streams_per_client): misses for that call
    UNAUTHENTICATED / PERMISSION_DENIED  wrong token: down for max(down_backoff_s, 30 s),
                                         logged once at ERROR, never a retry per call
    anything else (UNAVAILABLE, DEADLINE_EXCEEDED, a reply breaking the wire contract)
                                         down for ``down_backoff_s``: its keys are misses

While down, calls answer at once without touching the network; the first call after the
back-off is the probe. State changes only on the connection's event loop: no locks.
"""

from __future__ import annotations

import logging
import time

import grpc
import grpc.aio

from nopecache.client.metrics import ClientMetrics

__all__ = ["REFUSED_BACKOFF_S", "ServerHealth"]

log = logging.getLogger("nopecache.client.transport")

# Failures of these codes are about one request, not about the server.
_REQUEST_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT})
# The server is alive but refuses more work from this client now: misses for that call.
_BUSY_CODES = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED})
# The server rejects this client's credentials: a configuration error that retrying does
# not fix, so the server is left alone for at least REFUSED_BACKOFF_S between probes.
_REFUSED_CODES = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})
REFUSED_BACKOFF_S = 30.0


class ServerHealth:
    """Down-until, refused and busy flags of one server, with their logging and counting."""

    def __init__(
        self, address: str, down_backoff_s: float, metrics: ClientMetrics | None = None
    ) -> None:
        """A healthy server at ``address``; failures mark it down for ``down_backoff_s``."""
        self.address = address
        self.down_backoff_s = down_backoff_s
        self._metrics = metrics
        self.down_until = 0.0  # time.monotonic() at which a down server is tried again
        self._down = False
        self._refused = False  # the server rejected our credentials and has not accepted since
        self._busy = False  # a call was refused RESOURCE_EXHAUSTED and none succeeded since

    def is_down(self) -> bool:
        """Whether the server failed (or refused our token) recently: its keys are misses."""
        return time.monotonic() < self.down_until

    def failed(self, method: str, error: BaseException) -> None:
        """Log (once per outage), count, and mark the server down unless the request was bad
        or the server only busy; a credentials refusal backs off longer (module docstring)."""
        # A reply that breaks the wire contract counts as INTERNAL (the server misbehaved).
        code = error.code() if isinstance(error, grpc.aio.AioRpcError) else None
        code_name = code.name if code is not None else grpc.StatusCode.INTERNAL.name
        if self._metrics is not None:
            self._metrics.record_server_error(self.address, code_name)
        detail = error.details() if isinstance(error, grpc.aio.AioRpcError) else str(error)
        if code in _REQUEST_CODES:
            log.error(
                "nopecache %s %s refused the request (%s): %s",
                *(self.address, method, code_name, detail),
            )
            return
        if code in _BUSY_CODES:
            if not self._busy:
                self._busy = True
                log.warning(
                    "nopecache server %s is busy in %s (%s: %s); this call's keys are misses",
                    *(self.address, method, code_name, detail),
                )
            return
        if code in _REFUSED_CODES:
            backoff = max(self.down_backoff_s, REFUSED_BACKOFF_S)
            self.down_until = time.monotonic() + backoff
            if not self._refused:
                self._refused = True
                log.error(
                    "nopecache server %s refused this client's credentials in %s (%s: %s): "
                    "check ClientConfig.token (?token=) against the server's auth tokens; "
                    "its keys are misses, asked again every %.0fs",
                    *(self.address, method, code_name, detail, backoff),
                )
            return
        self.down_until = time.monotonic() + self.down_backoff_s
        if not self._down:
            self._down = True
            log.warning(
                "nopecache server %s failed in %s (%s: %s); its keys are misses for %.1fs",
                *(self.address, method, code_name, detail, self.down_backoff_s),
            )

    def unreachable(self, keys: int) -> None:
        """Count ``keys`` that became misses because the server could not answer."""
        if self._metrics is not None and keys:
            self._metrics.record_unreachable(self.address, keys)

    def succeeded(self) -> None:
        """A call went through: clear the busy/refused/down flags (logging recoveries)."""
        self._busy = False
        if self._refused:
            self._refused = False
            log.info("nopecache server %s accepts this client's credentials now", self.address)
        if self._down:
            self._down = False
            log.info("nopecache server %s is answering again", self.address)
