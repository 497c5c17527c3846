"""Who holds the server's call slots, and the fair share of them each one may hold.

A *principal* is whoever a limit is counted against::

    a call with a valid bearer token     the tenant ("tenant:alice")
    a KVCache call, auth off             its connection ("conn:ipv4:10.0.0.7:51234")
    any other call without a token       its peer's address ("probe:ipv4:10.0.0.7"):
    (health, reflection)                 health and reflection need no token, so
                                         only the address tells two callers apart

:class:`CallLimiter` (a grpc.aio server interceptor, first in the chain) admits every
call of every service by these rules:

1. a probe (a call counted against a peer's address) is admitted while its address has
   fewer than ``max_probe_calls_per_peer`` calls in flight and all probes together fewer
   than ``PROBE_SHARE`` of ``max_concurrent_rpcs``;
2. any other call is admitted while all calls together are fewer than
   ``max_concurrent_rpcs``; past that, only while its principal holds fewer than its fair
   share, ``max_concurrent_rpcs // (principals holding calls)``.

Anything else is refused ``RESOURCE_EXHAUSTED`` with a message naming the option. The
transport's own cap (gRPC's ``maximum_concurrent_rpcs``, refused with no name) is set
past what rule 2 can ever admit (:func:`transport_rpc_cap`: each principal grows past
the cap only up to its share, so the total stays under twice the cap plus the probes),
so that no principal reaches it and locks the others out. The per-tenant stream limit
(``max_streams_per_client``, auth.py) still applies after this.

Why fair share and not a fixed split: the number of principals is not known (tenants
come and go; without auth every connection is one), and a fixed split would refuse a
lone busy client calls that nobody else wants.

Concurrency: the interceptor and its counters are used from the event loop only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import grpc

from nopecache.cache_server.auth import AuthFailure, TokenTable, tenant_of
from nopecache.cache_server.interception import Handler, WrappingInterceptor, guarded
from nopecache.cache_server.metrics import ServerMetrics

__all__ = [
    "PROBE_SHARE",
    "CallLimiter",
    "Principal",
    "peer_address",
    "transport_rpc_cap",
]

# All probes (calls without a token outside KVCache) together hold at most this share of
# max_concurrent_rpcs: many addresses probing at once still leave the tenants the rest.
PROBE_SHARE = 8

log = logging.getLogger(__name__)


def peer_address(peer: str) -> str:
    """The address of a gRPC peer string without its port (``ipv4:1.2.3.4:5`` ->
    ``ipv4:1.2.3.4``, ``ipv6:[::1]:5`` -> ``ipv6:[::1]``); other forms unchanged."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6") and ":" in rest:
        return f"{kind}:{rest.rpartition(':')[0]}"
    return peer


def transport_rpc_cap(max_concurrent_rpcs: int) -> int:
    """The cap to give gRPC's ``maximum_concurrent_rpcs``: more than CallLimiter admits.

    Past ``max_concurrent_rpcs`` each of n principals grows only to its share (cap // n),
    so non-probe calls stay under 2 x cap; probes add at most cap // PROBE_SHARE + 1.
    """
    return 2 * max_concurrent_rpcs + max_concurrent_rpcs // PROBE_SHARE + 1


@dataclass(frozen=True, slots=True)
class Principal:
    """Whom a call is counted against; ``probe`` for a tokenless non-KVCache call."""

    name: str
    probe: bool


class CallLimiter(WrappingInterceptor):
    """Admits each call by its principal's share (see the module docstring)."""

    def __init__(
        self,
        service_name: str,
        *,
        tokens: TokenTable | None,
        max_concurrent_rpcs: int,
        max_probe_calls_per_peer: int,
        metrics: ServerMetrics,
    ) -> None:
        if max_concurrent_rpcs < 1 or max_probe_calls_per_peer < 1:
            raise ValueError("max_concurrent_rpcs and max_probe_calls_per_peer must be >= 1")
        self._prefix = f"/{service_name}/"
        self._tokens = tokens
        self.cap = max_concurrent_rpcs
        self.probe_cap = max_probe_calls_per_peer
        self.probe_total_cap = max(1, max_concurrent_rpcs // PROBE_SHARE)
        self._metrics = metrics
        self._held: dict[Principal, int] = {}
        self.total = 0
        self.probes = 0

    def held(self, name: str) -> int:
        """Calls in flight counted against the principal called ``name``."""
        return sum(n for p, n in self._held.items() if p.name == name)

    def principal(self, method: str, metadata: Any, peer: str) -> Principal:
        """Whom a call of ``method`` from ``peer`` with ``metadata`` is counted against."""
        if self._tokens is not None:
            tenant = tenant_of(self._tokens, metadata)
            if not isinstance(tenant, AuthFailure):
                return Principal(f"tenant:{tenant.name}", probe=False)
        if method.startswith(self._prefix):
            # Without auth each connection is a client; with auth a call without a valid
            # token is refused by the gate at once, so it holds its slot for an instant.
            return Principal(f"conn:{peer}", probe=False)
        return Principal(f"probe:{peer_address(peer)}", probe=True)

    def refusal(self, who: Principal) -> str | None:
        """Why a new call of ``who`` is refused now, or None when it is admitted."""
        held = self._held.get(who, 0)
        if who.probe:
            if held >= self.probe_cap:
                return (
                    f"max_probe_calls_per_peer: {self.probe_cap} calls without a token "
                    "already in flight from this address"
                )
            if self.probes >= self.probe_total_cap:
                return (
                    f"max_concurrent_rpcs: calls without a token may hold "
                    f"{self.probe_total_cap} of the {self.cap} slots, all in use"
                )
            return None
        if self.total < self.cap:
            return None
        holders = sum(1 for p in self._held if not p.probe) + (0 if held else 1)
        share = max(1, self.cap // holders)
        if held < share:
            return None
        return (
            f"max_concurrent_rpcs: {self.total} calls in flight (cap {self.cap}); this "
            f"client holds {held}, its fair share of {holders} clients is {share}"
        )

    def _take(self, who: Principal) -> None:
        self._held[who] = self._held.get(who, 0) + 1
        self.total += 1
        self.probes += who.probe

    def _give(self, who: Principal) -> None:
        n = self._held[who] - 1
        if n:
            self._held[who] = n
        else:
            del self._held[who]
        self.total -= 1
        self.probes -= who.probe

    def wrap(self, handler: Handler, details: grpc.HandlerCallDetails) -> Handler:
        """The handler of this call, wrapped to take and give back its principal's slot."""
        method = details.method

        async def enter(context: grpc.aio.ServicerContext) -> Principal:
            who = self.principal(method, details.invocation_metadata, context.peer())
            why = self.refusal(who)
            if why is not None:
                self._metrics.rejected(method.rpartition("/")[2], "too_many_calls")
                log.debug("%s refused for %s: %s", method, who.name, why)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)
            self._take(who)
            return who

        return guarded(handler, enter, self._give)
