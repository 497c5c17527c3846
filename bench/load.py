"""Load test: 64 concurrent clients with a mixed put/get/lookup workload against one server
process, for a bounded time, measuring throughput, latency, errors and server memory.

Setup (loopback only): the server runs as its own process with a CPU tier of
``--capacity`` bytes (``pinned=no``), tune_malloc as configured by ``--tune-malloc``,
behind the front proxy of the deployment (HAProxy with deploy/haproxy/haproxy.cfg,
tests/support/haproxy_proc.py): every client dials the proxy, the bulk stream included
(the server announces the proxy's bulk port). 64 asyncio client tasks share 8 channels
(8 connections) and, until ``--seconds`` pass, each loops over one operation at a time:

    40% Put     one block of 32 KiB, 128 KiB or 512 KiB (the key picks the size)
    40% Get     1-4 keys (hits and misses), every returned block compared bit for bit
    20% Lookup  64 keys

Keys come from a space whose blocks add up to about twice the capacity, so the tier
evicts all along. Blocks are built on the fly from the key (deterministic payload), so
the client holds no copy of the data set.

Reported: ops/s, p50/p99 latency per operation and overall, errors (failed RPCs, refused
blocks, wrong bytes), the server's peak RSS (sampled from /proc every 100 ms) against
the configured capacity, and its RSS when idle before the load. What the RSS is made of
(measured on the dev machine): the CPU pool, resident from the start (it is a zeroed
``bytearray``); about 60 MiB of interpreter, gRPC, numpy and protobuf whatever the
capacity; and 30-40 MiB of in-flight buffers under this load (gRPC messages, staged Put
blocks, Get copies; ``tune_malloc`` keeps them for reuse). The fixed part makes the
ratio capacity-dependent: about 1.10 at the default 1 GiB, about 1.4 at 256 MiB.
Hostile clients (``--attack-seconds``, after the load; see ``bench/_hostile.py``): the
server runs with bearer tokens, and beside one well-behaved *victim* (64-key Lookups back
to back) and a filler that keeps the cache evicting, hostile tenants send compression
bombs, Put streams that stop sending, Get streams that are never read, and a quota game
(tiny blocks, then the same keys with big blocks once evicted). Measured against the
server's own bounds: ``hostile_rss_over_budget`` is the peak RSS over the whole run
divided by idle RSS + capacity + ``max_inflight_bytes`` (target <= 1.10);
``victim_p99_ms`` the victim's Lookup p99 during the attack (target <= 50), beside its
p99 alone before anything else ran (``victim_alone_p99_ms``, the baseline);
``quota_overrun`` the gamer's largest real holding (its blocks a Lookup finds, in whole
pages) over its quota (target <= 1.0). The attackers of issue 25 run in the same phase
(``bench/_attackers.py``: a tokenless Watch flood, an idle-connection flood, slow-loris
Puts at 256 streams, budget squatters, bulk squatters, idle bulk connections):
``victim_ok_share`` is the share of the victim's Lookups that succeed (target >= 0.99)
and ``new_client_ok_share`` the share of clients connecting during the attack whose
Lookup succeeds (target >= 0.99). The attackers of issue 36 join them (``bench/_proxied.py``:
drip squatters on gRPC and bulk Puts, a Health.Watch flood from 16 addresses on the
proxy's health frontend, a keep-alive connection hoarder from 4 addresses), and each
attacker comes from loopback addresses of its own (127.0.0.2 and up) while the honest
clients come from 127.0.0.1: the proxy's per-source limits are in the picture.
``health_ok_share`` is the share of kubelet-like probes (a fresh connection to the
server's health listener every 0.25 s, one Check, 3 s timeout) answered SERVING
(target >= 0.99). ``honest_slow_put_ok`` (bench/_honest.py): the server's Put rate for an
8 MiB block is measured unloaded before the load (the best of 3 Puts through the proxy);
a quarter into the hostile phase an honest client (the good tenant, from 127.0.0.1)
Puts another 8 MiB block from a reader paced at a tenth of that rate (never below the
server's default ``min_stream_rate``) and reads it back: 1 when it is stored (one try)
and comes back bit for bit (the Get again while the server answers "retry later": the
mix can keep the in-flight budget full), else 0.

Last line::

    RESULT ops=... ops_per_s=... p50_ms=... p99_ms=... errors=... rss_mib=...
           capacity_mib=... rss_over_capacity=... hostile_rss_over_budget=...
           victim_p99_ms=... victim_alone_p99_ms=... quota_overrun=...
           victim_ok_share=... new_client_ok_share=... health_ok_share=...
           honest_slow_put_ok=...
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import xxhash
from _honest import slow_put_rate
from _hostile import GOOD, attack, server_put_rate, tokens_toml, victim_alone
from _hostile import channel as tenant_channel
from _proxied import Relays, Route

from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from nopecache.proto.block import StoredForm, build_block
from tests.support.haproxy_proc import HAProxyProc, ProxyPorts
from tests.support.ready import wait_serving

# The RESULT line's keys, in order: tests/bench/test_quick.py checks a --quick run
# prints exactly these.
RESULT_KEYS = (
    "ops",
    "ops_per_s",
    "p50_ms",
    "p99_ms",
    "errors",
    "rss_mib",
    "idle_rss_mib",
    "inflight_mib",
    "capacity_mib",
    "rss_over_capacity",
    "hostile_rss_over_budget",
    "victim_p99_ms",
    "victim_alone_p99_ms",
    "quota_overrun",
    "victim_ok_share",
    "new_client_ok_share",
    "health_ok_share",
    "honest_slow_put_ok",
)

TASKS = 64
CHANNELS = 8
SIZES = (32 * 1024, 128 * 1024, 512 * 1024)
FRAME = 4 * 1024 * 1024 - 4096  # the server's default max_frame_data_bytes
_NOISE = random.Random(0).randbytes(max(SIZES) + 4096)
# The server's bounds for the run (the hostile phase tests that they hold).
INFLIGHT_BYTES = 384 * 1024 * 1024
IDLE_S = 5  # the server's connection_idle_timeout_s (the hoarder checks within it)
SERVER_LIMITS = (
    *("--max-request-bytes", "64MiB", "--max-inflight-bytes", str(INFLIGHT_BYTES)),
    *("--max-inflight-bytes-per-client", "128MiB", "--stream-idle-timeout-s", "3"),
    # Short enough that the idle-connection flood meets it within the hostile phase.
    *("--connection-idle-timeout-s", str(IDLE_S)),
)


def key_of(i: int) -> bytes:
    """The 16-byte key of block number ``i``."""
    return xxhash.xxh3_128_digest(i.to_bytes(8, "little"))


def block_of(i: int) -> bytes:
    """Block ``i``: a valid float16 block whose size and payload follow from ``i``."""
    size = SIZES[i % len(SIZES)]
    head_dim = 64
    tokens = size // (2 * 2 * head_dim)
    offset = (i * 7919) % 4096
    return build_block(
        key=key_of(i),
        fingerprint=b"load-model",
        form=StoredForm.NOPE,
        dtype="float16",
        shape=(1, tokens, 1, head_dim),
        v_head_dim=head_dim,
        token_ids=list(range(tokens)),
        payload=_NOISE[offset : offset + 4 * tokens * head_dim],
    )


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid``."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Server:
    """The server process under test, behind the front proxy."""

    def __init__(self, workdir: Path, capacity: int, tune: bool) -> None:
        self.ports = ProxyPorts.free()
        self.port = self.ports.server_grpc
        self.proxy = HAProxyProc(self.ports, workdir / "haproxy.log")
        self.log = workdir / "server.log"
        tokens = workdir / "tokens.toml"
        tokens.write_text(tokens_toml())
        self.command = [
            sys.executable,
            *("-m", "nopecache.cache_server", "--host", "127.0.0.1", "--port", str(self.port)),
            *("--no-metrics", "--tier", f"cpu://?capacity={capacity}&pinned=no"),
            "--tune-malloc" if tune else "--no-tune-malloc",
            *("--max-streams-per-client", "1024", "--log-level", "WARNING"),
            *("--auth-tokens-file", str(tokens), *SERVER_LIMITS),
            *self.ports.server_args(),
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """The server's own gRPC address (clients dial the proxy: :meth:`route`)."""
        return f"127.0.0.1:{self.port}"

    def route(self, relays: dict[str, str]) -> Route:
        """Where each client dials (the proxy; attackers through ``relays``)."""
        return Route(
            proxy_host=self.proxy.host,
            grpc_port=self.ports.grpc,
            bulk_port=self.ports.bulk,
            health_port=self.ports.health,
            server_health=f"127.0.0.1:{self.ports.server_health}",
            relays=relays,
        )

    def start(self) -> int:
        """Start the server, wait until SERVING; its pid."""
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=log)
        # An exit is reported at once (code and log lines); the bound is a hang guard only.
        wait_serving(
            self.proc,
            self.address,
            self.log,
            timeout_s=600.0,
            service="nopecache.v1.KVCache",
        )
        self.proxy.start()
        return self.proc.pid

    def stop(self) -> None:
        """SIGTERM, then wait (the proxy first)."""
        self.proxy.stop()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


class Load:
    """The client side: counters shared by the tasks."""

    def __init__(self, n_keys: int, seconds: float) -> None:
        self.n_keys = n_keys
        self.seconds = seconds
        self.latency: dict[str, list[float]] = {"Put": [], "Get": [], "Lookup": []}
        self.errors: list[str] = []
        self.hits = self.misses = 0

    async def task(self, stub: cache_pb2_grpc.KVCacheAsyncStub, seed: int, end: float) -> None:
        """One client: operations back to back until ``end``."""
        rng = random.Random(seed)
        while time.monotonic() < end:
            op = rng.choices(("Put", "Get", "Lookup"), (4, 4, 2))[0]
            started = time.perf_counter()
            try:
                if op == "Put":
                    await self._put(stub, rng.randrange(self.n_keys))
                elif op == "Get":
                    await self._get(
                        stub, [rng.randrange(self.n_keys) for _ in range(rng.randint(1, 4))]
                    )
                else:
                    keys = b"".join(key_of(rng.randrange(self.n_keys)) for _ in range(64))
                    reply = await stub.Lookup(pb.LookupRequest(keys=keys))
                    if len(reply.tiers) != 64:
                        self.errors.append("Lookup: wrong answer length")
            except grpc.aio.AioRpcError as e:
                self.errors.append(f"{op}: {e.code().name} {e.details()}")
            self.latency[op].append(time.perf_counter() - started)

    async def _put(self, stub: cache_pb2_grpc.KVCacheAsyncStub, i: int) -> None:
        blob = block_of(i)

        async def frames() -> AsyncIterator[pb.PutFrame]:
            yield pb.PutFrame(key=key_of(i), total_size=len(blob), data=blob)

        reply = await stub.Put(frames())
        if reply.results[0].outcome == pb.PUT_OUTCOME_REJECTED:
            self.errors.append(f"Put: rejected: {reply.results[0].reason}")

    async def _get(self, stub: cache_pb2_grpc.KVCacheAsyncStub, ids: Sequence[int]) -> None:
        parts: dict[int, list[bytes]] = {}
        async for frame in stub.Get(pb.GetRequest(keys=b"".join(key_of(i) for i in ids))):
            if frame.tier or frame.index in parts:
                parts.setdefault(frame.index, []).append(frame.data)
        for index, i in enumerate(ids):
            if index not in parts:
                self.misses += 1
            elif b"".join(parts[index]) != block_of(i):
                self.errors.append(f"Get: wrong bytes for block {i}")
            else:
                self.hits += 1


async def run_load(address: str, load: Load) -> float:
    """Run the 64 tasks; the wall time they took."""
    channels = [tenant_channel(address, GOOD) for _ in range(CHANNELS)]
    stubs = [cache_pb2_grpc.KVCacheStub(c) for c in channels]
    started = time.monotonic()
    end = started + load.seconds
    await asyncio.gather(*(load.task(stubs[n % CHANNELS], n, end) for n in range(TASKS)))
    elapsed = time.monotonic() - started
    for channel in channels:
        await channel.close(None)
    return elapsed


async def sample_rss(pid: int, peak: list[int], stop: asyncio.Event) -> None:
    """Keep ``peak[0]`` at the largest RSS seen until ``stop``."""
    while not stop.is_set():
        peak[0] = max(peak[0], rss_bytes(pid))
        await asyncio.sleep(0.1)


def pct_ms(values: list[float], q: float) -> float:
    """The q-quantile of ``values`` already in milliseconds (0 when empty)."""
    return pct(values, q) / 1000


def pct(values: list[float], q: float) -> float:
    """The q-quantile of ``values`` in milliseconds (0 when empty)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def main_async(args: argparse.Namespace) -> int:
    """Start the server, run the load, print the report."""
    capacity = args.capacity_mib * 1024 * 1024
    mean_size = statistics.mean(SIZES)
    n_keys = int(2 * capacity / mean_size)
    with tempfile.TemporaryDirectory(prefix="nopecache-load-") as tmp:
        server = Server(Path(tmp), capacity, args.tune_malloc)
        pid = server.start()
        try:
            with Relays(server.proxy.grpc_address, server.proxy.health_address) as relays:
                route = server.route(relays)
                await asyncio.sleep(0.5)
                idle = rss_bytes(pid)
                load = Load(n_keys, args.seconds)
                peak, stop = [idle], asyncio.Event()
                sampler = asyncio.create_task(sample_rss(pid, peak, stop))
                alone = await victim_alone(route.grpc("victim"), args.alone_seconds)
                put_rate = await server_put_rate(route.grpc("honest"))
                elapsed = await run_load(route.grpc("load"), load)
                load_peak = peak[0]
                hostile = await attack(
                    route,
                    args.attack_seconds,
                    idle_s=IDLE_S - 1,
                    slow_rate=slow_put_rate(put_rate),
                    quick=args.quick,
                )
                stop.set()
                await sampler
                after = rss_bytes(pid)
        finally:
            server.stop()
    everything = [x for values in load.latency.values() for x in values]
    ops = len(everything)
    mib = 1024 * 1024
    print(
        f"{TASKS} tasks, {CHANNELS} connections, {elapsed:.1f} s, {n_keys} keys of "
        f"{'/'.join(str(s // 1024) for s in SIZES)} KiB, capacity {args.capacity_mib} MiB, "
        f"tune_malloc={'on' if args.tune_malloc else 'off'}"
    )
    for op, values in load.latency.items():
        print(
            f"  {op:7} {len(values):7d} ops  p50 {pct(values, 0.5):7.2f} ms  p99 {pct(values, 0.99):7.2f} ms"
        )
    print(f"  get hits {load.hits}, misses {load.misses}")
    print(
        f"  server RSS: idle {idle / mib:.0f} MiB, peak {peak[0] / mib:.0f} MiB, end {after / mib:.0f} MiB"
    )
    for error in load.errors[:10]:
        print(f"  error: {error}")
    bound = idle + capacity + INFLIGHT_BYTES
    print(
        f"  hostile phase {args.attack_seconds:.0f} s: victim {len(hostile.victim_ms)} lookups "
        f"(p50 {pct_ms(hostile.victim_ms, 0.5):.2f} ms), bombs refused {hostile.bombs_refused} "
        f"stored {hostile.bombs_stored}, slow puts cut {hostile.puts_cut}, slow gets cut "
        f"{hostile.gets_cut}, filler errors {hostile.filler_errors}, peak RSS "
        f"{peak[0] / mib:.0f} MiB (load phase {load_peak / mib:.0f} MiB) against "
        f"{bound / mib:.0f} MiB (idle + capacity + max_inflight_bytes)"
    )
    flood = hostile.flood
    print(
        f"  floods: victim {hostile.victim_failed} failed lookups; watches held "
        f"{flood.watches_held}; idle connections held {flood.idle_held} (closed by the "
        f"server {flood.idle_closed_by_server}); slow-loris cut {flood.loris_cut}; "
        f"squatters cut {flood.squat_cut}; bulk squatters closed {flood.bulk_squat_closed}; "
        f"idle bulk connections {flood.idle_bulk_opened}; new clients {flood.new_ok} ok "
        f"{flood.new_failed} failed"
    )
    proxied = hostile.proxy
    print(
        f"  through the proxy: drip puts cut {proxied.drip_cut} (bulk {proxied.drip_bulk_cut}); "
        f"health watches held on the proxy's health frontend {proxied.health_watches_held}; "
        f"hoarded connections {proxied.hoarded}; kubelet-like probes {proxied.probes_ok} ok "
        f"{proxied.probes_failed} failed"
    )
    print(
        f"  honest slow client: unloaded Put rate {put_rate / mib:.1f} MiB/s, paced at "
        f"{slow_put_rate(put_rate) / mib:.2f} MiB/s; {hostile.honest_slow_note}"
    )
    for note in hostile.notes[:10]:
        print(f"  hostile: {note}")
    print(
        f"RESULT ops={ops} ops_per_s={ops / elapsed:.0f} p50_ms={pct(everything, 0.5):.2f} "
        f"p99_ms={pct(everything, 0.99):.2f} errors={len(load.errors)} "
        f"rss_mib={load_peak / mib:.0f} idle_rss_mib={idle / mib:.0f} "
        f"inflight_mib={(load_peak - idle) / mib:.0f} capacity_mib={args.capacity_mib} "
        f"rss_over_capacity={load_peak / capacity:.3f} "
        f"hostile_rss_over_budget={peak[0] / bound:.3f} "
        f"victim_p99_ms={pct_ms(hostile.victim_ms, 0.99):.2f} "
        f"victim_alone_p99_ms={pct_ms(alone, 0.99):.2f} "
        f"quota_overrun={hostile.quota_overrun():.3f} "
        f"victim_ok_share={hostile.victim_ok_share():.3f} "
        f"new_client_ok_share={hostile.flood.new_client_ok_share():.3f} "
        f"health_ok_share={proxied.health_ok_share():.3f} "
        f"honest_slow_put_ok={int(hostile.honest_slow_put_ok)}"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the options and run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="load duration (default 60)")
    parser.add_argument(
        "--capacity-mib",
        type=int,
        default=1024,
        help="CPU tier capacity (default 1024: the server's default tier size)",
    )
    parser.add_argument(
        "--attack-seconds",
        type=float,
        default=20.0,
        help="duration of the hostile phase after the load (default 20)",
    )
    parser.add_argument(
        "--tune-malloc",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the server's tune_malloc option (default on, as the server's default)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run (what make test runs): 64 MiB, every phase for a second or two",
    )
    args = parser.parse_args(argv)
    # The victim's baseline, alone on the server before the load.
    args.alone_seconds = 3.0
    if args.quick:
        args.seconds, args.attack_seconds, args.capacity_mib, args.alone_seconds = 2, 2, 64, 1
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
