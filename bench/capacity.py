"""Capacity below memory: an agent fleet's hits at a fixed memory budget (CPU tier alone,
with the disk tier below it, and with fp8 blocks), the disk tier's read rate against a raw
read of the same file, the hits a restarted server keeps, and what fp8 costs.

Four measurements, each with its baseline in the same run:

- ``hit_cpu``, ``hit_cpu_disk``, ``hit_cpu_disk_fp8``: ``bench/_capacity_replay.py``: the
  agent traces of ``bench/_traces.py`` for ``--fleets`` tenants, sessions interleaved,
  replayed through the real client and a real server process whose CPU tier holds a
  quarter of the trace's working set (measured by a dry run); hit tokens over prompt
  tokens with the CPU tier alone, above a disk tier that holds the working set, and the
  same with the client storing fp8 (``kv_codec=fp8``). ``hit_ceiling``: the dry run's (no
  eviction), ``hit_cpu_fp8``: fp8 with the CPU tier alone.

- ``disk_vs_raw``: a ``DiskTier`` (``file://``) is filled with ``--blocks`` blocks of
  ``--block-kib`` KiB, closed and reopened (the index rebuilt from the slabs, as after a
  restart), then every block is read back with ``get``, ``2 x threads`` reads in flight
  (each read verified: header, length, xxh3). The baseline reads the same byte ranges of
  the same slab files with ``os.preadv`` on the same number of threads, with O_DIRECT when
  the tier uses it, into aligned buffers, and checks nothing. Both are timed best of
  ``--reps`` alternating runs; the ratio is tier GB/s over raw GB/s.
- ``restart_hit_ratio``: a real server process (``python -m nopecache.cache_server``) with
  a CPU tier of 1/32 of the working set above a disk tier that holds it all; every block
  is Put over gRPC, then Get (hits before), the server is stopped with SIGTERM and a new
  one started on the same directory, and every block is Get again (hits after). A block
  only in memory at the stop is lost (memory is not written down at shutdown); the pass
  of Gets before the stop promotes disk blocks and so pushes the last-put blocks from
  memory to disk, so here everything is expected back.

- ``fp8_bytes_ratio``, ``fp8_top1``, ``fp8_kl``: ``bench/_capacity_quality.py``: the
  bytes the fp8 replay stored over the raw replay's (headers included), and on SmolLM2
  through the transformers adapter, exact-prefix reuse of fp8 blocks against the same
  reuse of raw ones (top-1 agreement and KL along the full prefill's answer); K16/V8 and
  blend reuse are printed beside them, with each codec's encode and decode GB/s.

Last line: ``RESULT hit_cpu=... hit_cpu_disk=... hit_cpu_disk_fp8=... disk_vs_raw=...
restart_hit_ratio=... fp8_bytes_ratio=... fp8_top1=... fp8_kl=... hit_ceiling=...
hit_cpu_fp8=... disk_gbps=... raw_gbps=... rebuild_s=... blocks=...``. Usage: ``python
bench/capacity.py [--blocks N] [--block-kib K] [--fleets N] [--prompts N] [--dir PATH]
[--quick]`` (``--dir``: where the slabs go, default a temporary folder on ``/var/tmp``;
pick the disk you want to measure; ``--prompts``: quality prompts, 0: the whole report
half).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from _capacity_quality import codec_speed, quality
from _capacity_replay import fleet_trace, replay
from _capacity_replay import server as replay_server

from nopecache.cache_server.tiers.disk import DiskTier
from nopecache.cache_server.tiers.disk_file import ALIGN, ThreadBuffers
from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from nopecache.proto.kv_codec import CODECS
from tests.support.redis_procs import free_ports
from tests.support.server_harness import make_block
from tests.support.server_procs import CacheServerProc

# The RESULT line's keys, in order: tests/bench/test_quick.py checks a --quick run
# prints exactly these.
RESULT_KEYS = (
    "hit_cpu",
    "hit_cpu_disk",
    "hit_cpu_disk_fp8",
    "disk_vs_raw",
    "restart_hit_ratio",
    "fp8_bytes_ratio",
    "fp8_top1",
    "fp8_kl",
    "hit_ceiling",
    "hit_cpu_fp8",
    "disk_gbps",
    "raw_gbps",
    "rebuild_s",
    "blocks",
)
BUDGET_SHARE = 0.25  # the CPU tier holds this share of the working set

PAGE = 256 * 1024
THREADS = 4
FRAME = 1024 * 1024  # Put frame data (under the server's default 4 MiB messages)
HANG_S = 600.0  # gRPC deadlines: only a hang guard on a loaded machine


def _tier(path: Path, blocks: int, block_bytes: int) -> DiskTier:
    pages = blocks * -(-(block_bytes + 4096) // PAGE)
    return DiskTier(path, pages * PAGE, page_bytes=PAGE, threads=THREADS)


async def _fill(path: Path, blocks: int, block_bytes: int) -> None:
    tier = _tier(path, blocks, block_bytes)
    try:
        payload = os.urandom(block_bytes)
        for i in range(blocks):
            # One distinct byte per block: a misplaced read fails its checksum.
            blob = i.to_bytes(8, "little") + payload[8:]
            await tier.put(i.to_bytes(16, "little"), blob)
    finally:
        await tier.close()


async def _tier_read(tier: DiskTier, keys: list[bytes]) -> int:
    """Every block read through the tier, ``2 x threads`` reads in flight at any time (as
    concurrent requests keep a server's readers busy); the payload bytes read."""
    window = asyncio.Semaphore(2 * THREADS)
    got = 0

    async def one(key: bytes) -> None:
        nonlocal got
        async with window:
            blob = await tier.get(key)
        assert blob is not None, "a block written before is missing"
        got += len(blob)

    await asyncio.gather(*(one(k) for k in keys))
    return got


def _raw_read(tier: DiskTier, keys: list[bytes], pool: ThreadPoolExecutor) -> int:
    """The same bytes read straight from the slabs (each record rounded up to 4 KiB, as
    O_DIRECT needs): no header parsing, no checksum, no copy out; the bytes read."""
    jobs = []
    for k in keys:
        placement, nbytes = tier.placement(k), tier.record_bytes(k)
        assert placement is not None and nbytes is not None
        jobs.append((placement.runs, -(-nbytes // ALIGN) * ALIGN))

    def read(job: tuple[tuple[tuple[int, int], ...], int]) -> int:
        runs, left = job
        buf = buffers.get(left)
        with memoryview(buf) as view:
            pos = 0
            for fd, offset, size in tier.slabs.segments(runs):
                size = min(size, left - pos)
                if size <= 0:
                    break
                pos += os.preadv(fd, [view[pos : pos + size]], offset)
        return pos

    buffers = ThreadBuffers()
    try:
        return sum(pool.map(read, jobs))
    finally:
        buffers.close()


async def disk_vs_raw(path: Path, blocks: int, block_bytes: int, reps: int) -> tuple[float, ...]:
    """(tier GB/s, raw GB/s, rebuild seconds) over one filled tier."""
    await _fill(path, blocks, block_bytes)
    tier = _tier(path, blocks, block_bytes)
    keys = [i.to_bytes(16, "little") for i in range(blocks)]
    assert len(tier.lru_keys()) == blocks, "the rebuilt index lost blocks"
    tier_best = raw_best = float("inf")
    tier_bytes = 0
    with ThreadPoolExecutor(THREADS) as pool:
        for _ in range(reps):
            t0 = time.perf_counter()
            raw_bytes = await asyncio.to_thread(_raw_read, tier, keys, pool)
            del raw_bytes  # the rate counts the same payload bytes for both
            raw_best = min(raw_best, time.perf_counter() - t0)
            t0 = time.perf_counter()
            tier_bytes = await _tier_read(tier, keys)
            tier_best = min(tier_best, time.perf_counter() - t0)
    rebuild = tier.rebuilt.seconds
    direct = tier.direct
    await tier.close()
    disk_gbps, raw_gbps = tier_bytes / tier_best / 1e9, tier_bytes / raw_best / 1e9
    print(
        f"{blocks} blocks of {block_bytes} B: disk tier {disk_gbps:.2f} GB/s, raw preadv of "
        f"the same records {raw_gbps:.2f} GB/s (best of {reps}, {THREADS} threads, O_DIRECT "
        f"{'on' if direct else 'off'}); index rebuilt in {rebuild:.3f} s",
        flush=True,
    )
    return disk_gbps, raw_gbps, rebuild


def _put(stub: cache_pb2_grpc.KVCacheStub, key: bytes, blob: bytes) -> None:
    frames = [pb.PutFrame(key=key, total_size=len(blob), data=blob[:FRAME])]
    frames += [pb.PutFrame(data=blob[i : i + FRAME]) for i in range(FRAME, len(blob), FRAME)]
    reply = stub.Put(iter(frames), timeout=HANG_S)
    assert reply.results[0].outcome == pb.PUT_OUTCOME_STORED, reply


def _hits(stub: cache_pb2_grpc.KVCacheStub, blocks: Sequence[tuple[bytes, bytes]]) -> int:
    """How many of ``blocks`` a Get returns, each checked bit-exact."""
    hits = 0
    for key, blob in blocks:
        data = b"".join(
            f.data for f in stub.Get(pb.GetRequest(keys=key), timeout=HANG_S) if f.tier or f.data
        )
        if data:
            assert data == blob, "a block came back different"
            hits += 1
    return hits


def restart_hit_ratio(workdir: Path, blocks: int, tokens: int) -> float:
    """Hits after a restart on the same disk over hits before, through a real server."""
    stored = []
    for i in range(blocks):
        key = i.to_bytes(16, "little")
        stored.append((key, make_block(key, tokens=tokens, head_dim=128, layers=2)))
    size = len(stored[0][1])
    cpu = max(size, blocks * size // 32)
    disk = 2 * blocks * -(-(size + 4096) // PAGE) * PAGE
    tiers = (
        f"cpu://?capacity={cpu}&page=64KiB&pinned=no",
        f"file://{workdir / 'disk'}?capacity={disk}&page={PAGE}",
    )
    server = CacheServerProc(workdir / "server", free_ports(1)[0], tiers=tiers)
    server.start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = cache_pb2_grpc.KVCacheStub(channel)
            for key, blob in stored:
                _put(stub, key, blob)
            before = _hits(stub, stored)
        server.stop()
        t0 = time.perf_counter()
        server.start()
        print(f"restart: serving again after {time.perf_counter() - t0:.2f} s", flush=True)
        with grpc.insecure_channel(server.address) as channel:
            after = _hits(cache_pb2_grpc.KVCacheStub(channel), stored)
    finally:
        server.kill()
    print(f"hits before the restart: {before}/{blocks}, after: {after}/{blocks}", flush=True)
    return after / before if before else 0.0


def hit_rates(workdir: Path, fleets: int, max_sessions: int) -> dict[str, float]:
    """The fleet replay's hit rates per configuration and the fp8 bytes ratio."""
    trace = fleet_trace(seed=0, fleets=fleets, max_sessions=max_sessions)
    tokens = sum(len(p.tokens) for p in trace)
    print(f"trace: {len(trace)} requests, {tokens} prompt tokens, {fleets} tenants", flush=True)
    # Dry run: a small CPU tier above a disk that holds everything loses nothing, so the
    # bytes stored are the working set.
    big_disk = 4 * tokens * 1024 + (64 << 20)
    with replay_server(workdir / "dry", 16 << 20, big_disk) as address:
        dry = replay(address, trace)
    budget = int(dry.stored_bytes * BUDGET_SHARE)
    disk = 2 * dry.stored_bytes + (64 << 20)
    print(
        f"working set {dry.stored_bytes / 2**20:.1f} MiB, CPU tier {budget / 2**20:.1f} MiB; "
        f"no eviction: hit {dry.hit_rate:.3f} ({dry.seconds:.0f} s)",
        flush=True,
    )
    runs = {
        "hit_cpu": (0, "none"),
        "hit_cpu_fp8": (0, "fp8"),
        "hit_cpu_disk": (disk, "none"),
        "hit_cpu_disk_fp8": (disk, "fp8"),
    }
    out = {"hit_ceiling": dry.hit_rate}
    stored: dict[str, int] = {}
    for name, (disk_bytes, codec) in runs.items():
        with replay_server(workdir / name, budget, disk_bytes) as address:
            r = replay(address, trace, codec)
        out[name] = r.hit_rate
        stored[name] = r.stored_bytes
        print(
            f"{name}: hit {r.hit_rate:.3f}, stored {r.stored_bytes / 2**20:.1f} MiB "
            f"({r.seconds:.0f} s)",
            flush=True,
        )
    # Both disk runs store every block once (nothing is lost below the disk).
    out["fp8_bytes_ratio"] = stored["hit_cpu_disk_fp8"] / stored["hit_cpu_disk"]
    return out


def fp8_quality(prompts: int) -> tuple[float, float]:
    """fp8's (top-1, KL) on exact prefixes against the raw form; every codec's figures and
    speeds printed."""
    for codec in CODECS[1:]:
        ratio, enc, dec = codec_speed(codec, rounds=1 if prompts == 1 else 3)
        print(
            f"{codec}: payload {ratio:.4f} of bf16, encode {enc:.2f} GB/s, decode "
            f"{dec:.2f} GB/s (bf16 bytes, one Llama-3-8B-shaped 256-token block)",
            flush=True,
        )
    began = time.perf_counter()
    found = quality(
        CODECS[1:],
        prompts,
        lambda line: print(f"[{time.perf_counter() - began:6.1f}s] {line}", flush=True),
    )
    for q in found:
        print(
            f"{q.codec}: exact prefix top-1 {q.exact.mean_top1:.4f} KL {q.exact.mean_kl:.2e}; "
            f"blend (default policy) top-1 {q.blend.mean_top1:.4f} KL {q.blend.mean_kl:.2e} "
            f"facts kept {q.blend.fact_kept:.3f} (of {len(q.blend.facts)}), vs the raw form",
            flush=True,
        )
    fp8 = next(q for q in found if q.codec == "fp8")
    return fp8.exact.mean_top1, fp8.exact.mean_kl


def main(argv: Sequence[str] | None = None) -> int:
    """Run the measurements and print the RESULT line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--blocks", type=int, default=2048, help="blocks in the disk tier")
    parser.add_argument("--block-kib", type=int, default=1024, help="block size in KiB")
    parser.add_argument("--reps", type=int, default=3, help="timed reads of each kind")
    parser.add_argument("--fleets", type=int, default=4, help="tenants in the replayed trace")
    parser.add_argument("--prompts", type=int, default=0, help="quality prompts (0: all)")
    parser.add_argument("--dir", type=Path, default=None, help="where the slabs go")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 32 small blocks")
    args = parser.parse_args(argv)
    blocks, block_kib, reps = args.blocks, args.block_kib, args.reps
    fleets, sessions, prompts = args.fleets, 0, args.prompts
    if args.quick:
        blocks, block_kib, reps = 32, 256, 1
        fleets, sessions, prompts = 1, 4, 1
    root = Path(tempfile.mkdtemp(prefix="nopecache-capacity-", dir=args.dir or "/var/tmp"))
    try:
        hits = hit_rates(root / "replay", fleets, sessions)
        disk_gbps, raw_gbps, rebuild = asyncio.run(
            disk_vs_raw(root / "tier", blocks, block_kib * 1024, reps)
        )
        ratio = restart_hit_ratio(root / "restart", 64 if args.quick else 640, 64)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    top1, kl = fp8_quality(prompts)
    print(
        f"RESULT hit_cpu={hits['hit_cpu']:.3f} hit_cpu_disk={hits['hit_cpu_disk']:.3f} "
        f"hit_cpu_disk_fp8={hits['hit_cpu_disk_fp8']:.3f} disk_vs_raw={disk_gbps / raw_gbps:.3f} "
        f"restart_hit_ratio={ratio:.3f} fp8_bytes_ratio={hits['fp8_bytes_ratio']:.4f} "
        f"fp8_top1={top1:.4f} fp8_kl={kl:.3e} hit_ceiling={hits['hit_ceiling']:.3f} "
        f"hit_cpu_fp8={hits['hit_cpu_fp8']:.3f} disk_gbps={disk_gbps:.3f} "
        f"raw_gbps={raw_gbps:.3f} rebuild_s={rebuild:.3f} blocks={blocks}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
