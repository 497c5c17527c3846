"""Health that an attacker cannot take (issue 36, finding 2: never-ending Health.Watch
streams from one address, or from several, made every health check fail, the liveness
probe's included). Real servers on loopback; callers at other 127.0.0.x addresses come
through tests/support/source_address.py."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nopecache.cache_server.config import ConfigError
from nopecache.cache_server.health_port import HEALTH_PORT_WATCHES, main_port_watches
from nopecache.cache_server.main import start_server
from nopecache.cache_server.principals import PROBE_SHARE
from nopecache.cache_server.service import SERVICE_NAME
from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from tests.support.server_harness import SMALL, serving
from tests.support.source_address import relay_from

SERVING = health_pb2.HealthCheckResponse.SERVING
# 64 call slots: tokenless calls (health, reflection) hold at most 64 // PROBE_SHARE = 8;
# before the fix 8 Watch streams from one address took them all.
FEW_SLOTS = replace(SMALL, max_concurrent_rpcs=64)
# Watch streams each attacking address opens: the per-address probe cap (8) before the fix.
PER_ADDRESS = 8
# gRPC shares one connection among a process's channels to the same address unless told.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
# Hang guard only: an answer on loopback takes milliseconds.
CALL_TIMEOUT_S = 10.0


class WatchFlood:
    """Never-ending Health.Watch streams; which were admitted and what refused the rest."""

    def __init__(self) -> None:
        self.open: list[grpc.aio.UnaryStreamCall] = []
        self.refusals: list[tuple[grpc.StatusCode, str]] = []

    async def watch(self, channel: grpc.aio.Channel, n: int) -> None:
        """Open ``n`` Watch streams on ``channel``, one after the other."""
        stub = health_pb2_grpc.HealthStub(channel)
        for _ in range(n):
            call = stub.Watch(health_pb2.HealthCheckRequest(service=""))
            try:
                first = await asyncio.wait_for(call.read(), CALL_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                self.refusals.append((e.code(), e.details() or ""))
                continue
            assert first.status == SERVING
            self.open.append(call)

    def cancel(self) -> None:
        """End every admitted stream."""
        for call in self.open:
            call.cancel()


@contextlib.asynccontextmanager
async def channels_from(sources: list[str], target: str) -> AsyncIterator[list[grpc.aio.Channel]]:
    """One channel per source address to ``target`` (127.0.0.1 directly, others relayed)."""
    async with contextlib.AsyncExitStack() as stack:
        out = []
        for source in sources:
            address = target
            if source != "127.0.0.1":
                address = await stack.enter_async_context(relay_from(source, target))
            out.append(await stack.enter_async_context(grpc.aio.insecure_channel(address)))
        yield out


async def check(channel: grpc.aio.Channel, service: str = "") -> int:
    """The health status of ``service``, asked with Check."""
    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=CALL_TIMEOUT_S)
    return int(reply.status)


async def wait_until(predicate: Callable[[], bool], what: str) -> None:
    """Poll ``predicate`` until true; fail after a generous bound."""
    for _ in range(200):  # 200 x 50 ms = 10 s: a release takes milliseconds on loopback
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not reached in 10 s: {what}")


def refusals(total: int, per_address: int, addresses: int) -> list[tuple[grpc.StatusCode, str]]:
    """What a flood of ``per_address`` Watch streams from each of ``addresses`` gets
    refused, address after address, on a listener holding ``total`` (2 per address)."""
    per_peer = (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "max_health_watches_per_peer: 2 Health.Watch streams already open from this address",
    )
    all_in_use = (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"Health.Watch: {total} streams open on this listener, all in use",
    )
    admitted_addresses = total // 2
    return [per_peer] * (per_address - 2) * admitted_addresses + [all_in_use] * per_address * (
        addresses - admitted_addresses
    )


@pytest.mark.asyncio
async def test_watch_floods_on_the_grpc_port_leave_checks_answered() -> None:
    """8 addresses x 8 Watch streams took every tokenless slot; now Checks are answered."""
    sources = [f"127.0.0.{i}" for i in range(1, 9)]
    total = main_port_watches(FEW_SLOTS.max_concurrent_rpcs)
    assert (total, FEW_SLOTS.max_health_watches_per_peer) == (4, 2)
    assert FEW_SLOTS.max_concurrent_rpcs // PROBE_SHARE == 2 * total
    async with (
        serving(FEW_SLOTS) as h,
        channels_from([*sources, "127.0.0.9"], h.running.address) as chans,
    ):
        limiter = h.running.watches
        assert limiter is not None
        flood = WatchFlood()
        try:
            for channel in chans[:-1]:
                await flood.watch(channel, PER_ADDRESS)
            assert len(flood.open) == total
            assert flood.refusals == refusals(total, PER_ADDRESS, len(sources))
            assert limiter.held("ipv4:127.0.0.1") == limiter.held("ipv4:127.0.0.2") == 2
            refused = {"method": "Watch", "reason": "too_many_watches"}
            assert h.sample("nopecache_requests_rejected_total", refused) == len(flood.refusals)
            # A caller the flood never used, and the flood's own addresses: answered.
            for channel in (chans[-1], chans[0], chans[5]):
                assert await check(channel) == SERVING
                assert await check(channel, SERVICE_NAME) == SERVING
        finally:
            flood.cancel()
        # Ended streams give their slots back: a new caller may watch again.
        await wait_until(lambda: limiter.total == 0, "the ended Watch streams released")
        again = WatchFlood()
        await again.watch(chans[-1], 2)
        assert (len(again.open), again.refusals) == (2, [])
        again.cancel()


@pytest.mark.asyncio
async def test_the_health_listener_answers_when_the_grpc_port_is_full() -> None:
    """Probes at health_listen pass whatever fills the gRPC port's connections and slots,
    and a Watch flood there from 17 addresses leaves Checks answered."""
    config = replace(FEW_SLOTS, max_connections=2, health_listen="127.0.0.1:0")
    async with serving(config) as h:
        assert h.running.health_port is not None
        health = f"127.0.0.1:{h.running.health_port}"
        limiter = h.running.health_watches
        assert limiter is not None and limiter.total_cap == HEALTH_PORT_WATCHES
        # Two clients hold the gRPC port's two connections: a third is refused there...
        async with (
            grpc.aio.insecure_channel(h.running.address, options=OWN_CONNECTION) as one,
            grpc.aio.insecure_channel(h.running.address, options=OWN_CONNECTION) as two,
            grpc.aio.insecure_channel(h.running.address, options=OWN_CONNECTION) as third,
        ):
            for channel in (one, two):
                assert await check(channel) == SERVING
            with pytest.raises(grpc.aio.AioRpcError) as full:
                await check(third)
            assert full.value.code() == grpc.StatusCode.UNAVAILABLE
            # ... while the health listener answers, under a Watch flood of its own.
            sources = [f"127.0.0.{i}" for i in range(1, 18)]
            async with channels_from([*sources, "127.0.0.99"], health) as chans:
                flood = WatchFlood()
                try:
                    for channel in chans[:-1]:
                        await flood.watch(channel, PER_ADDRESS)
                    # 16 addresses fill the listener's total; the 17th is refused outright.
                    assert len(flood.open) == HEALTH_PORT_WATCHES == 2 * (len(sources) - 1)
                    assert flood.refusals == refusals(
                        HEALTH_PORT_WATCHES, PER_ADDRESS, len(sources)
                    )
                    for channel in (chans[-1], chans[0]):
                        assert await check(channel) == SERVING  # liveness
                        assert await check(channel, SERVICE_NAME) == SERVING  # readiness
                finally:
                    flood.cancel()
                await wait_until(lambda: limiter.total == 0, "the ended Watch streams released")
        # The listener serves health only.
        async with grpc.aio.insecure_channel(health) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as no_kv:
                await cache_pb2_grpc.KVCacheStub(channel).Stats(
                    pb.StatsRequest(), timeout=CALL_TIMEOUT_S
                )
            assert no_kv.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("where", ["", "127.0.0.1", "127.0.0.1:x"])
def test_health_listen_values_are_checked(where: str) -> None:
    if not where:
        assert replace(SMALL, health_listen=where).health_listen == ""
        return
    with pytest.raises(ConfigError, match=r"^health_listen: expected HOST:PORT"):
        replace(SMALL, health_listen=where)


@pytest.mark.parametrize("option", ["health_listen", "admin_listen"])
@pytest.mark.asyncio
async def test_a_busy_listener_port_is_one_line_naming_its_option(option: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = replace(SMALL, **{option: f"127.0.0.1:{port}"})  # type: ignore[arg-type]
        with pytest.raises(ConfigError) as refused:
            await start_server(config)
    flag = "--" + option.replace("_", "-")
    assert str(refused.value) == (
        f"{option}: cannot listen on 127.0.0.1:{port} (Address already in use); choose "
        f"another address or port with {flag} (or NOPECACHE_{option.upper()})"
    )
