"""bench/load.py through the front proxy (deploy/haproxy/haproxy.cfg): where each client
comes from, the relays that give gRPC clients a source address, the kubelet-like health
prober, and the attackers of issue 36 that need the proxy in the picture (loopback only).

Every client dials the proxy. Honest clients (the load, the victim, the filler, the new
clients) come from 127.0.0.1; each attacker from addresses of its own (``SOURCES``), so
the proxy's per-source limits are what stands between them and the others. gRPC
cannot bind its source address: a relay process (``python _proxied.py relay``, running
tests/support/source_address.py's relays, apart from the attackers' event loop) dials
the proxy from each attacker's address; raw-socket attackers bind theirs.

    drip             tenant drip: Put streams (gRPC and bulk) that announce a 64 MiB block
                     and send one byte every 0.5 s, again each time one is cut
    health_flood     no token: 8 never-ending Health.Watch streams from each of 16
                     addresses on the proxy's health frontend, re-opened as they end
    hoarder          no token: connections from 4 addresses that each send one
                     Health.Check per idle period (a keep-alive connection hoarder)
    prober           what a kubelet does: a fresh connection to the server's health
                     listener every 0.25 s, one Check with a 3 s timeout (in a process
                     of its own); ``health_ok_share`` is the share that answer SERVING
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from nopecache.proto.bulk import BLOCK, MAGIC, encode_put, hello
from tests.support.source_address import relay_from

MiB = 1024 * 1024
DRIP = "drip-token-2f7a9c4e1b"
HONEST = "127.0.0.1"
# Attacker -> its source address(es) on loopback.
SOURCES: dict[str, tuple[str, ...]] = {
    "bombs": ("127.0.0.2",),
    "slow_put": ("127.0.0.3",),
    "slow_get": ("127.0.0.4",),
    "gamer": ("127.0.0.5",),
    "watch_flood": ("127.0.0.6",),
    "idle_flood": tuple(f"127.0.0.{i}" for i in range(7, 11)),
    "slow_loris": ("127.0.0.11",),
    "budget_squat": ("127.0.0.12",),
    "bulk_squat": ("127.0.0.13",),
    "idle_bulk": ("127.0.0.14",),
    "drip": ("127.0.0.15",),
    "health_flood": tuple(f"127.0.0.{i}" for i in range(20, 36)),
    "hoarder": tuple(f"127.0.0.{i}" for i in range(40, 44)),
}
DRIP_STREAMS = 8
DRIP_BULK = 4
HEALTH_WATCHES = 8
HOARD_PER_SOURCE = 48
PROBE_EVERY_S = 0.25
PROBE_TIMEOUT_S = 3.0  # the manifests' timeoutSeconds


def tenants_toml() -> str:
    """The drip tenant, for the server's tokens file."""
    return f'[tenants.drip]\ntokens = ["{DRIP}"]\n'


@dataclass
class ProxyReport:
    """What the attackers of this module and the prober saw."""

    drip_cut: int = 0
    drip_bulk_cut: int = 0
    health_watches_held: int = 0
    hoarded: int = 0
    probes_ok: int = 0
    probes_failed: int = 0
    notes: list[str] = field(default_factory=list)

    def health_ok_share(self) -> float:
        """The share of the prober's checks answered SERVING (0.0 when none ran)."""
        total = self.probes_ok + self.probes_failed
        return self.probes_ok / total if total else 0.0


@dataclass(frozen=True)
class Route:
    """Where each client dials: the proxy, directly or through a relay from its source."""

    proxy_host: str
    grpc_port: int
    bulk_port: int
    health_port: int
    server_health: str  # the server's health listener (the kubelet's, not proxied)
    relays: dict[str, str]  # "grpc SOURCE" / "health SOURCE" -> relay address

    def grpc(self, name: str, i: int = 0) -> str:
        """The gRPC address attacker ``name`` (its ``i``-th source) dials; honest clients
        (any name not in SOURCES) dial the proxy from 127.0.0.1."""
        if name not in SOURCES:
            return f"{self.proxy_host}:{self.grpc_port}"
        sources = SOURCES[name]
        return self.relays[f"grpc {sources[i % len(sources)]}"]

    def source(self, name: str, i: int = 0) -> str:
        """The source address of attacker ``name``'s ``i``-th raw socket."""
        sources = SOURCES.get(name, (HONEST,))
        return sources[i % len(sources)]


class Relays:
    """``with Relays(grpc_target, health_target) as relays``: a child process relaying
    from every attacker's source address; ``relays`` maps ``"grpc SRC"`` and
    ``"health SRC"`` to the addresses to dial."""

    def __init__(self, grpc_target: str, health_target: str) -> None:
        self._args = [grpc_target, health_target]
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> dict[str, str]:
        self._proc = subprocess.Popen(
            [sys.executable, __file__, "relay", *self._args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"relay process exited with {self._proc.wait()}")
        relays: dict[str, str] = json.loads(line)
        return relays

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.close()  # the child ends at EOF
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


async def _serve_relays(grpc_target: str, health_target: str) -> None:
    async with contextlib.AsyncExitStack() as stack:
        out = {}
        grpc_sources = {s for name, ss in SOURCES.items() if name != "health_flood" for s in ss}
        for s in sorted(grpc_sources):
            out[f"grpc {s}"] = await stack.enter_async_context(relay_from(s, grpc_target))
        for s in SOURCES["health_flood"]:
            out[f"health {s}"] = await stack.enter_async_context(relay_from(s, health_target))
        print(json.dumps(out), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def prober_process(address: str, seconds: float) -> tuple[int, int]:
    """Run the prober against ``address`` in a process of its own; (ok, failed)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "probe", address, str(seconds), stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"prober process exited with {proc.returncode}")
    result = json.loads(out.decode().splitlines()[-1])
    return int(result["ok"]), int(result["failed"])


async def _probe(address: str, seconds: float) -> tuple[int, int]:
    ok = failed = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.monotonic()
        try:
            async with grpc.aio.insecure_channel(
                address, options=[("grpc.use_local_subchannel_pool", 1)]
            ) as ch:
                reply = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=PROBE_TIMEOUT_S
                )
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            ok, failed = ok + serving, failed + (not serving)
        except grpc.aio.AioRpcError:
            failed += 1
        await asyncio.sleep(max(0.0, PROBE_EVERY_S - (time.monotonic() - started)))
    return ok, failed


async def drip(route: Route, n: int, end: float, report: ProxyReport) -> None:
    """gRPC Puts announcing 64 MiB, one byte every 0.5 s; cut ones are opened again."""
    from _hostile import channel, key

    async def frames(i: int) -> AsyncIterator[pb.PutFrame]:
        yield pb.PutFrame(key=key("drip", i), total_size=64 * MiB, data=b"x")
        while time.monotonic() < end:
            await asyncio.sleep(0.5)
            yield pb.PutFrame(data=b"x")

    async with channel(route.grpc("drip"), DRIP) as ch:
        stub = cache_pb2_grpc.KVCacheStub(ch)

        async def one(i: int) -> None:
            while time.monotonic() < end - 0.5:
                try:
                    await stub.Put(frames(i), timeout=max(0.1, end - time.monotonic()))
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        raise
                    report.drip_cut += 1
                except grpc.aio.AioRpcError:
                    report.drip_cut += 1
                    await asyncio.sleep(0.2)

        await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)


async def drip_bulk(route: Route, n: int, end: float, report: ProxyReport) -> None:
    """Bulk PUTs announcing a 64 MiB block, one byte every 0.5 s; again when closed."""
    from _attackers import _bulk_tickets
    from _hostile import key

    async def one(i: int) -> None:
        while time.monotonic() < end - 0.5:
            ((port, ticket),) = await _bulk_tickets(route.grpc("drip"), DRIP, 1)
            if not port:
                await asyncio.sleep(0.5)
                continue
            try:
                reader, writer = await asyncio.open_connection(
                    route.proxy_host, port, local_addr=(route.source("drip"), 0)
                )
            except OSError:
                await asyncio.sleep(0.5)
                continue
            try:
                writer.write(hello(ticket))
                if await asyncio.wait_for(reader.readexactly(len(MAGIC)), 10) != MAGIC:
                    continue
                writer.write(encode_put(1) + BLOCK.pack(64 * MiB, key("dripbulk", i)))
                while time.monotonic() < end:
                    writer.write(b"x")
                    await writer.drain()
                    with contextlib.suppress(TimeoutError):
                        if not await asyncio.wait_for(reader.read(65536), 0.5):
                            break  # closed by the server
                report.drip_bulk_cut += time.monotonic() < end
            except (OSError, asyncio.IncompleteReadError, TimeoutError):
                report.drip_bulk_cut += 1
                await asyncio.sleep(0.2)
            finally:
                writer.close()

    await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)


async def health_flood(route: Route, watches: int, end: float, report: ProxyReport) -> None:
    """``watches`` Watch streams from each address on the proxy's health frontend."""
    held: dict[str, int] = {}

    async def from_source(source: str) -> None:
        address = route.relays[f"health {source}"]
        while time.monotonic() < end:
            async with grpc.aio.insecure_channel(
                address, options=[("grpc.use_local_subchannel_pool", 1)]
            ) as ch:
                health = health_pb2_grpc.HealthStub(ch)
                calls = [health.Watch(health_pb2.HealthCheckRequest()) for _ in range(watches)]
                for call in calls:
                    with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
                        await asyncio.wait_for(call.read(), 2)
                held[source] = sum(not c.done() for c in calls)
                report.health_watches_held = max(report.health_watches_held, sum(held.values()))
                while time.monotonic() < end and not all(c.done() for c in calls):
                    await asyncio.sleep(0.5)
                held[source] = 0
                for call in calls:
                    call.cancel()
            await asyncio.sleep(0.5)

    sources = SOURCES["health_flood"]
    await asyncio.gather(*(from_source(s) for s in sources), return_exceptions=True)


async def hoarder(
    route: Route, per_source: int, idle_s: float, end: float, report: ProxyReport
) -> None:
    """Connections that each send one Health.Check per ``idle_s`` and nothing else."""
    alive: set[int] = set()

    async def one(i: int) -> None:
        async with grpc.aio.insecure_channel(
            route.grpc("hoarder", i), options=[("grpc.use_local_subchannel_pool", 1)]
        ) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < end:
                try:
                    await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                    alive.add(i)
                    report.hoarded = max(report.hoarded, len(alive))
                except grpc.aio.AioRpcError:
                    alive.discard(i)
                await asyncio.sleep(idle_s)

    n = per_source * len(SOURCES["hoarder"])
    await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)


@dataclass(frozen=True)
class ProxySizes:
    """How many of each attacker of this module run."""

    drip_streams: int = DRIP_STREAMS
    drip_bulk: int = DRIP_BULK
    health_watches: int = HEALTH_WATCHES
    hoard_per_source: int = HOARD_PER_SOURCE


FULL = ProxySizes()
QUICK = ProxySizes(2, 1, 2, 4)


def proxied_attackers(
    route: Route, end: float, idle_s: float, report: ProxyReport, sizes: ProxySizes = FULL
) -> list[tuple[str, Coroutine[None, None, None]]]:
    """(name, coroutine) of every attacker of this module and the prober."""

    async def probe() -> None:
        seconds = max(0.5, end - time.monotonic())
        report.probes_ok, report.probes_failed = await prober_process(route.server_health, seconds)

    return [
        ("drip", drip(route, sizes.drip_streams, end, report)),
        ("drip_bulk", drip_bulk(route, sizes.drip_bulk, end, report)),
        ("health_flood", health_flood(route, sizes.health_watches, end, report)),
        ("hoarder", hoarder(route, sizes.hoard_per_source, idle_s, end, report)),
        ("prober", probe()),
    ]


if __name__ == "__main__":
    # python _proxied.py relay GRPC_TARGET HEALTH_TARGET  (serves until stdin closes)
    # python _proxied.py probe ADDRESS SECONDS            (prints {"ok": n, "failed": m})
    if sys.argv[1] == "relay":
        asyncio.run(_serve_relays(sys.argv[2], sys.argv[3]))
    else:
        _ok, _failed = asyncio.run(_probe(sys.argv[2], float(sys.argv[3])))
        print(json.dumps({"ok": _ok, "failed": _failed}))
