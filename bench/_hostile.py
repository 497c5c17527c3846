"""Hostile clients for bench/load.py, beside a well-behaved victim (loopback only).

Tenants (bearer tokens, one tokens file for the server, see :func:`tokens_toml`)::

    good    the well-behaved load of load.py, and a filler that keeps the cache evicting
    victim  one client doing 64-key Lookups back to back: its latency is the measure
    evil    compression bombs, Put streams that stop sending, Get streams never read
    gamer   a quota of ``GAMER_QUOTA``: tiny blocks first (one page each), then the same
            keys again with 1 MiB blocks once the filler has pushed them out

Measured: the victim's Lookup latency (p99), what the gamer really holds against its
quota (its keys a Lookup finds, each counted in whole tier pages, sampled all along; the
largest sample over the quota is ``quota_overrun``), and how the attack went (bombs
refused, streams cut). The attackers of issue 25 (floods of calls, connections and bulk
sockets, slow-loris Puts, budget squatters, idle bulk buffers, and clients connecting
during all that) are in _attackers.py, those of issue 36 (drip squatters, a health-watch
flood, a keep-alive connection hoarder) and the kubelet-like health prober in
_proxied.py; all run in the same phase, every client through the front proxy, each
attacker from addresses of its own (_proxied.py). Every loop is bounded by the phase's
end time.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import xxhash
from _attackers import FULL, QUICK, FloodReport, attackers, tenants_toml
from _honest import RATE_REPS, SLOW_PUT_BYTES, honest_slow_put, measure_put_rate
from _proxied import FULL as PROXIED_FULL
from _proxied import QUICK as PROXIED_QUICK
from _proxied import ProxyReport, Route, proxied_attackers
from _proxied import tenants_toml as proxied_tenants

from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from nopecache.proto.block import StoredForm, build_block

GOOD, VICTIM, EVIL, GAMER = (
    "good-token-5e1c9a7d3b",
    "victim-token-8b2f4d6a1c",
    "evil-token-3a9e7c5b1d",
    "gamer-token-6d4b2f8a0e",
)
GAMER_QUOTA = 8 * 1024 * 1024
EVIL_QUOTA = 64 * 1024 * 1024
PAGE = 64 * 1024  # the CPU tier's default page
MiB = 1024 * 1024
SLOW_PUTS = 24
SLOW_GETS = 24


def tokens_toml() -> str:
    """The server's tokens file: four tenants, quotas for the hostile ones."""
    return (
        f'[tenants.good]\ntokens = ["{GOOD}"]\n'
        f'[tenants.victim]\ntokens = ["{VICTIM}"]\n'
        f'[tenants.evil]\ntokens = ["{EVIL}"]\nquota = "{EVIL_QUOTA}"\n'
        f'[tenants.gamer]\ntokens = ["{GAMER}"]\nquota = "{GAMER_QUOTA}"\n'
        + tenants_toml()
        + proxied_tenants()
    )


def key(tag: str, i: int) -> bytes:
    """A 16-byte key of the hostile/victim key spaces."""
    return xxhash.xxh3_128_digest(f"{tag}:{i}".encode())


def block(k: bytes, payload_bytes: int, compression: str = "none", fill: bytes = b"") -> bytes:
    """A valid float16 block of about ``payload_bytes`` for key ``k``."""
    head_dim = 64
    tokens = max(1, payload_bytes // (4 * head_dim))
    layers = -(-tokens // 4096)  # a block holds at most 65536 tokens: spread over layers
    tokens //= layers
    n = 4 * layers * tokens * head_dim
    data = (fill or k) * (n // len(fill or k) + 1)
    return build_block(
        key=k,
        fingerprint=b"load-model",
        form=StoredForm.NOPE,
        dtype="float16",
        shape=(layers, tokens, 1, head_dim),
        v_head_dim=head_dim,
        token_ids=list(range(tokens)),
        payload=data[:n],
        compression=compression,
    )


def _with_token(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    metadata = (*(details.metadata or ()), ("authorization", f"Bearer {token}"))
    return details._replace(metadata=metadata)  # type: ignore[attr-defined]


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(_with_token(details, self.token), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(_with_token(details, self.token), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_stream_unary(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return await continuation(_with_token(details, self.token), requests)


def channel(address: str, token: str) -> grpc.aio.Channel:
    """A channel of its own (its own connection) whose calls carry ``token``."""
    # The stubs want a cast for client interceptors; any of the three kinds works.
    interceptors: list[Any] = [_UnaryUnary(token), _UnaryStream(token), _StreamUnary(token)]
    return grpc.aio.insecure_channel(
        address,
        options=[("grpc.use_local_subchannel_pool", 1)],
        interceptors=interceptors,
    )


async def _one(frames: list[pb.PutFrame]) -> AsyncIterator[pb.PutFrame]:
    for f in frames:
        yield f


def frames_of(k: bytes, blob: bytes, frame: int = MiB) -> list[pb.PutFrame]:
    """The PutFrames of one block."""
    out = [pb.PutFrame(key=k, total_size=len(blob), data=blob[:frame])]
    out += [pb.PutFrame(data=blob[i : i + frame]) for i in range(frame, len(blob), frame)]
    return out


@dataclass
class AttackReport:
    """What the hostile phase measured."""

    victim_ms: list[float] = field(default_factory=list)
    victim_failed: int = 0
    flood: FloodReport = field(default_factory=FloodReport)
    proxy: ProxyReport = field(default_factory=ProxyReport)
    gamer_peak_bytes: int = 0
    bombs_refused: int = 0
    bombs_stored: int = 0
    puts_cut: int = 0
    gets_cut: int = 0
    filler_errors: int = 0
    honest_slow_put_ok: bool = False
    honest_slow_note: str = "honest slow put: did not run"
    notes: list[str] = field(default_factory=list)

    def victim_ok_share(self) -> float:
        """The share of the victim's Lookups that succeeded."""
        total = len(self.victim_ms) + self.victim_failed
        return len(self.victim_ms) / total if total else 0.0

    def quota_overrun(self) -> float:
        """The gamer's largest real holding over its quota."""
        return self.gamer_peak_bytes / GAMER_QUOTA


async def victim_process(address: str, seconds: float) -> tuple[list[float], int]:
    """Run ``victim`` in a process of its own (so the hostile clients' work in this one
    cannot delay it) for ``seconds``; its Lookup latencies in ms and its failed Lookups."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        address,
        str(seconds),
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"victim process exited with {proc.returncode}")
    result = json.loads(out.decode().splitlines()[-1])
    return list(result["ms"]), int(result["failed"])


async def victim(address: str, end: float, report: AttackReport) -> None:
    """64-key Lookups back to back (a few of its own keys stored first)."""
    async with channel(address, VICTIM) as ch:
        stub = cache_pb2_grpc.KVCacheStub(ch)
        mine = [key("victim", i) for i in range(64)]
        await stub.Put(_one([f for k in mine[:8] for f in frames_of(k, block(k, 4096))]))
        packed = b"".join(mine)
        while time.monotonic() < end:
            started = time.perf_counter()
            try:
                await stub.Lookup(pb.LookupRequest(keys=packed), timeout=30)
            except grpc.aio.AioRpcError:
                report.victim_failed += 1
                await asyncio.sleep(0.01)
                continue
            report.victim_ms.append(1000 * (time.perf_counter() - started))
            await asyncio.sleep(0.002)


async def filler(address: str, end: float, report: AttackReport) -> None:
    """The good tenant storing fresh 512 KiB blocks: the cache keeps evicting."""
    async with channel(address, GOOD) as ch:
        stub = cache_pb2_grpc.KVCacheStub(ch)
        i = 0
        while time.monotonic() < end:
            k = key("filler", i)
            i += 1
            try:
                await stub.Put(_one(frames_of(k, block(k, 512 * 1024))), timeout=30)
            except grpc.aio.AioRpcError:
                report.filler_errors += 1


async def bombs(address: str, end: float, report: AttackReport) -> None:
    """Puts of lz4 blocks that expand to 128 MiB (about 0.5 MiB on the wire)."""
    bomb_key, blob = BOMB
    async with channel(address, EVIL) as ch:
        stub = cache_pb2_grpc.KVCacheStub(ch)
        while time.monotonic() < end:
            try:
                reply = await stub.Put(_one(frames_of(bomb_key, blob)), timeout=30)
            except grpc.aio.AioRpcError as e:
                report.notes.append(f"bomb: {e.code().name}")
                continue
            if reply.results[0].outcome == pb.PUT_OUTCOME_REJECTED:
                report.bombs_refused += 1
            else:
                report.bombs_stored += 1
            await asyncio.sleep(0.05)


async def slow_put(address: str, n: int, end: float, report: AttackReport) -> None:
    """A Put that sends half of a 4 MiB block and then nothing, again each time it is cut."""
    k = key("slowput", n)
    frames = frames_of(k, block(k, 4 * MiB))
    async with channel(address, EVIL) as ch:
        stub = cache_pb2_grpc.KVCacheStub(ch)

        async def stalls() -> AsyncIterator[pb.PutFrame]:
            for f in frames[: len(frames) // 2]:
                yield f
            await asyncio.sleep(max(0.0, end - time.monotonic()))

        while time.monotonic() < end - 0.5:
            try:
                await stub.Put(stalls(), timeout=max(0.1, end - time.monotonic()))
            except asyncio.CancelledError:
                # grpc.aio ends a client stream the server cut this way while its request
                # iterator still waits; a cancel of this task itself is passed on.
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                report.puts_cut += 1
            except grpc.aio.AioRpcError as e:
                if e.code() in (
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                ):
                    report.puts_cut += 1
                else:  # refused by the proxy, say: not again at once
                    await asyncio.sleep(0.1)


async def slow_get(address: str, n: int, end: float, report: AttackReport) -> None:
    """A Get of one 2 MiB block named 512 times whose reader reads one frame, then nothing."""
    k = key("slowget", n % 4)
    async with channel(address, EVIL) as ch:
        stub = cache_pb2_grpc.KVCacheStub(ch)
        # Again until stored: on a loaded machine the budget the squatters fill can cut it.
        while time.monotonic() < end - 0.5:
            try:
                await stub.Put(_one(frames_of(k, block(k, 2 * MiB))), timeout=30)
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.5)
        while time.monotonic() < end - 0.5:
            call = stub.Get(pb.GetRequest(keys=k * 512), timeout=max(0.1, end - time.monotonic()))
            try:
                await call.read()
                await asyncio.sleep(max(0.0, end - time.monotonic()))
            except grpc.aio.AioRpcError:
                pass
            finally:
                call.cancel()
            report.gets_cut += 1


async def quota_game(address: str, end: float, report: AttackReport) -> None:
    """Tiny blocks up to the quota, then the same keys with 1 MiB blocks once evicted."""
    async with channel(address, GAMER) as ch:
        stub = cache_pb2_grpc.KVCacheStub(ch)
        keys = [key("gamer", i) for i in range(4 * GAMER_QUOTA // PAGE)]
        held: dict[bytes, int] = {}  # key -> size of the block last stored

        async def put(k: bytes, blob: bytes) -> None:
            try:
                reply = await stub.Put(_one(frames_of(k, blob)), timeout=30)
            except grpc.aio.AioRpcError:
                # The in-flight budget the squatters fill can refuse a Put: a gamer that
                # stopped here would leave the quota unmeasured for the rest of the phase.
                await asyncio.sleep(0.1)
                return
            if reply.results[0].outcome == pb.PUT_OUTCOME_STORED:
                held[k] = len(blob)

        async def measure() -> list[bool]:
            reply = await stub.Lookup(pb.LookupRequest(keys=b"".join(keys)), timeout=30)
            present = [t != 0 for t in reply.tiers]
            real = sum(
                -(-held.get(k, 0) // PAGE) * PAGE for k, p in zip(keys, present, strict=True) if p
            )
            report.gamer_peak_bytes = max(report.gamer_peak_bytes, real)
            return present

        for k in keys:
            await put(k, block(k, 256))
        report.notes.append(f"gamer: {len(held)} of {len(keys)} tiny blocks stored")
        while time.monotonic() < end:
            present = await measure()
            for k, p in zip(keys, present, strict=True):
                if not p and time.monotonic() < end:
                    await put(k, block(k, MiB))
                    await measure()
            await asyncio.sleep(0.05)


def honest_block(tag: str) -> tuple[bytes, bytes]:
    """(key, block) of the honest slow client's size (_honest.py) in key space ``tag``."""
    k = key(tag, 0)
    return k, block(k, SLOW_PUT_BYTES)


async def server_put_rate(address: str) -> float:
    """The server's unloaded Put rate (bytes/s) for a block of the honest client's size."""
    async with channel(address, GOOD) as ch:
        blocks = [honest_block(f"rate{i}") for i in range(RATE_REPS)]
        return await measure_put_rate(cache_pb2_grpc.KVCacheStub(ch), blocks)


async def honest_slow(address: str, rate: float, start: float, report: AttackReport) -> None:
    """From ``start`` (monotonic) on: the honest slow Put at ``rate`` and its read-back."""
    k, blob = honest_block("honest-slow")
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    async with channel(address, GOOD) as ch:
        stub = cache_pb2_grpc.KVCacheStub(ch)
        report.honest_slow_put_ok, report.honest_slow_note = await honest_slow_put(
            stub, k, blob, rate
        )


# Built once, before the attack starts (128 MiB of zeros to compress).
BOMB = (key("bomb", 0), block(key("bomb", 0), 128 * MiB, compression="lz4", fill=b"\0"))


async def attack(
    route: Route, seconds: float, *, idle_s: float, slow_rate: float, quick: bool = False
) -> AttackReport:
    """Run every hostile client, the filler and the victim for ``seconds`` through the
    proxy of ``route`` (``idle_s``: the server's connection idle timeout, which the hoarder
    stays under; ``quick``: a handful of each flooding attacker), and the honest slow
    client at ``slow_rate`` bytes/s from a quarter into the phase (all attackers going)."""
    report = AttackReport()
    started = time.monotonic()
    end = started + seconds

    async def victim_task() -> None:
        report.victim_ms, report.victim_failed = await victim_process(route.grpc("victim"), seconds)

    tasks = [
        victim_task(),
        filler(route.grpc("filler"), end, report),
        bombs(route.grpc("bombs"), end, report),
        quota_game(route.grpc("gamer"), end, report),
        *(slow_put(route.grpc("slow_put"), n, end, report) for n in range(SLOW_PUTS)),
        *(slow_get(route.grpc("slow_get"), n, end, report) for n in range(SLOW_GETS)),
        honest_slow(route.grpc("honest"), slow_rate, started + seconds / 4, report),
    ]
    names = ["victim", "filler", "bombs", "quota_game", *["slow_put"] * SLOW_PUTS]
    names += [*["slow_get"] * SLOW_GETS, "honest_slow"]
    for name, work in [
        *attackers(route, end, report.flood, QUICK if quick else FULL),
        *proxied_attackers(
            route, end, idle_s, report.proxy, PROXIED_QUICK if quick else PROXIED_FULL
        ),
    ]:
        names.append(name)
        tasks.append(work)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for name, r in zip(names, results, strict=True):
        if isinstance(r, BaseException):
            report.notes.append(f"{name} failed: {type(r).__name__}: {r}")
    return report


async def victim_alone(address: str, seconds: float) -> list[float]:
    """The victim's Lookup latencies with nothing else running (the baseline)."""
    latencies, _ = await victim_process(address, seconds)
    return latencies


if __name__ == "__main__":
    # The victim process: python bench/_hostile.py ADDRESS SECONDS -> JSON latencies (ms).
    _report = AttackReport()
    _end = time.monotonic() + float(sys.argv[2])
    asyncio.run(victim(sys.argv[1], _end, _report))
    print(json.dumps({"ms": _report.victim_ms, "failed": _report.victim_failed}))
