"""The data plane against its ceilings: lookup + fetch into a paged cache, and store, beside
a raw loopback socket and an in-process memcpy of the same bytes, in one run.

Setup (all on 127.0.0.1): one ``python -m nopecache.cache_server`` child with a CPU tier
(the server applies its glibc allocator setting; the client process applies the same,
``nopecache.proto.allocator``), and this process as the engine. KV of two shapes, bf16,
stored as exact-prefix blocks of 256 tokens:

    smollm2     30 layers x 3 KV heads x 64   (22.5 KiB per token)
    llama3-8b   32 layers x 8 KV heads x 128  (128 KiB per token)

at 1024, 4096 and 16384 tokens (``--quick``: 256 and 1024 tokens of SmolLM2, 256 of
Llama-3-8B). Per shape and size, each the best of ``--reps`` after a warm-up, with
GB/s = 10^9 bytes of K and V payload per second::

    tcp       a Python socket sending the payload from a preallocated buffer, received
              with recv_into a preallocated buffer on another thread: the network ceiling
    memcpy    torch copy of the payload between two preallocated, touched buffers: the
              same-host ceiling
    net       CacheClient.lookup + CacheClient.fetch(into=PagedKV) with shm=off, bulk=auto
              (the default across hosts): Get payloads over the bulk byte stream,
              verification (checksums, key, fingerprint, tokens), placement into a
              vLLM-layout paged cache (16-slot pages, shuffled block table)
    net4      the same over four bulk streams (bulk_streams=4: keys dealt out in turn)
    samehost  the same with shm=on (the default for a server on this host): zero copy,
              blocks placed straight from the client's read-only mapping of the server's
              pool under read leases (checked: every block of the timed runs leased)
    grpc      the same with shm=off, bulk=off: gRPC Get streams (the TLS path)
    put       CacheClient.store of fresh blocks (Lookup, encode, Put), shm=off, bulk=auto
              (the default): blocks sent over the bulk byte stream
    putgrpc   the same with bulk=off: gRPC Put streams (the fallback)

Break-even: a GPU that prefills Llama-3-8B at R tokens/s makes 131072 * R bytes of KV a
second (128 KiB per token), so a path that fetches B bytes/s pays only below
R = B / 131072: ``breakeven_tok_s`` of the Llama-3-8B cases (an H100 prefills it at
roughly 10-20k tokens/s).

Cold start: a child process builds a CacheClient (which warms its channel, shared-memory
session, buffers and kernels at construction) and times its first lookup + fetch of
SmolLM2 1024 tokens against the best of the next five: ``cold_vs_warm``.

RESULT keys: ``tcp_gbps``, ``fetch_gbps`` (net: the default network path),
``streams4_vs_1`` (geometric mean of net4 / net over the cases of more than one block),
``samehost_gbps``, ``put_gbps`` (the bulk stream), ``put_grpc_gbps`` and ``grpc_gbps``
(the gRPC fallbacks) are geometric means over the cases; ``fetch_vs_tcp``, ``put_vs_tcp``,
``grpc_vs_tcp`` and ``samehost_vs_memcpy`` geometric means of the per-case ratios;
``fetch_scaling`` the worse shape's net GB/s at the largest size over the next smaller;
``breakeven_samehost_tok_s`` and ``breakeven_net_tok_s`` geometric means over the
Llama-3-8B cases. Targets: samehost_vs_memcpy >= 0.7, fetch_vs_tcp >= 0.8,
put_vs_tcp >= 0.6, breakeven_samehost_tok_s >= 40000, fetch_scaling >= 0.9,
cold_vs_warm <= 2.0.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from _harness import best_of, cache_server, paged_target

from nopecache.client import CacheClient, ClientConfig, ModelFingerprint, PagedKV
from nopecache.client.cost import CostConfig
from nopecache.kernels import RopeSpec
from nopecache.proto.block import StoredForm

# The RESULT line's keys, in order: tests/bench/test_quick.py checks a --quick run
# prints exactly these.
RESULT_KEYS = (
    "tcp_gbps",
    "fetch_gbps",
    "fetch_vs_tcp",
    "fetch_scaling",
    "streams4_vs_1",
    "samehost_gbps",
    "samehost_vs_memcpy",
    "cold_vs_warm",
    "put_gbps",
    "put_vs_tcp",
    "put_grpc_gbps",
    "grpc_gbps",
    "grpc_vs_tcp",
    "breakeven_samehost_tok_s",
    "breakeven_net_tok_s",
)

DTYPE = torch.bfloat16
PREFIX_BLOCK = 256
SHAPES = {"smollm2": (30, 3, 64), "llama3-8b": (32, 8, 128)}
SIZES = (1024, 4096, 16384)
QUICK_SIZES = {"smollm2": (256, 1024), "llama3-8b": (256,)}
COLD_SHAPE, COLD_TOKENS = "smollm2", 1024
BREAKEVEN_SHAPE = "llama3-8b"
LLAMA_BYTES_PER_TOKEN = 131072  # 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes


@dataclass(frozen=True, slots=True)
class Model:
    """One KV shape: its fingerprint and RoPE spec."""

    name: str
    layers: int
    heads: int
    dim: int

    @property
    def rope(self) -> RopeSpec:
        """The shape's RoPE spec."""
        return RopeSpec.default(self.dim)

    def fingerprint(self) -> ModelFingerprint:
        """Post-RoPE K (what vLLM holds): exact-prefix blocks come back at the positions
        they were stored at, so placement is a copy and the bench measures data movement,
        not RoPE arithmetic (bench/kernels.py measures that)."""
        return ModelFingerprint.from_rope_spec(
            model=f"{self.name}-shaped",
            revision="bench",
            num_layers=self.layers,
            num_kv_heads=self.heads,
            dtype=DTYPE,
            form=StoredForm.ROPE,
            rope=self.rope,
        )

    def client(self, address: str, path: str, namespace: str) -> CacheClient:
        """A client of this shape whose Gets take ``path`` ("grpc", "net": the bulk
        stream, "net4": four bulk streams, "samehost": shared memory, or "auto": the
        defaults); the cost model is off (every hit is fetched)."""
        config = ClientConfig(
            servers=(address,),
            get_timeout_s=120.0,
            put_timeout_s=120.0,
            cost=CostConfig(enabled=False),
            shm={"samehost": "on", "auto": "auto"}.get(path, "off"),  # type: ignore[arg-type]
            bulk="off" if path == "grpc" else "auto",
            bulk_streams=4 if path == "net4" else 1,
            namespace=namespace,
        )
        return CacheClient(
            config,
            fingerprint=self.fingerprint(),
            rope=self.rope,
            v_head_dim=self.dim,
            prefix_block_tokens=PREFIX_BLOCK,
        )

    def kv(self, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prompt token ids and random K, V ``[layers, tokens, heads, dim]``: random bf16
        bit patterns of finite values, made without a float32 intermediate (16k tokens of
        Llama-3-8B are 1 GiB each)."""
        g = torch.Generator().manual_seed(seed)
        shape = (self.layers, tokens, self.heads, self.dim)
        k, v = (
            torch.randint(0, 0x3F00, shape, generator=g, dtype=torch.int16).view(DTYPE)
            for _ in range(2)
        )
        return torch.randint(0, 50000, (tokens,), generator=g), k, v


# The baselines move the payload's bytes through buffers of at most this size, reused in
# turn (16k tokens of Llama-3-8B are 2 GiB: two whole-size buffers per baseline beside
# the KV and the paged cache do not fit a shared machine). Both ends stay far larger
# than any CPU cache, so the rate is the same as with whole-size buffers.
BASELINE_CHUNK = 256 * 1024 * 1024


def tcp_seconds(nbytes: int, reps: int) -> float:
    """Best time to move ``nbytes`` over a loopback TCP socket into preallocated memory."""
    chunk = min(nbytes, BASELINE_CHUNK)
    src = memoryview(bytearray(b"\x01") * chunk)
    view = memoryview(bytearray(chunk))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        sender = socket.create_connection(("127.0.0.1", port))
        receiver, _ = listener.accept()
    go = threading.Semaphore(0)

    def send() -> None:
        for _ in range(reps + 1):
            go.acquire()
            for start in range(0, nbytes, chunk):
                sender.sendall(src[: min(chunk, nbytes - start)])

    thread = threading.Thread(target=send, daemon=True)
    thread.start()

    def receive() -> None:
        go.release()
        got = 0
        while got < nbytes:
            at = got % chunk
            want = min(nbytes - got, chunk - at, 4 * 1024 * 1024)
            got += receiver.recv_into(view[at : at + want], want)

    try:
        return best_of(reps, receive)
    finally:
        thread.join()
        sender.close()
        receiver.close()


def memcpy_seconds(nbytes: int, reps: int) -> float:
    """Best time to copy ``nbytes`` between touched buffers (torch copies of up to
    BASELINE_CHUNK)."""
    chunk = min(nbytes, BASELINE_CHUNK)
    src = torch.ones(chunk, dtype=torch.uint8)
    dst = torch.zeros(chunk, dtype=torch.uint8)

    def copy() -> None:
        for start in range(0, nbytes, chunk):
            n = min(chunk, nbytes - start)
            dst[:n].copy_(src[:n])

    return best_of(reps, copy)


KV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def fetch_seconds(model: Model, address: str, path: str, kv: KV, into: PagedKV, reps: int) -> float:
    """Best lookup + fetch into the paged cache ``into`` of the stored ``kv`` (checked
    exact)."""
    prompt, k, v = kv
    tokens = prompt.numel()
    for caches in (into.k_caches, into.v_caches):
        assert caches is not None
        for cache in caches:
            cache.zero_()
    with model.client(address, path, f"fetch-{model.name}-{tokens}") as client:
        report = client.store(prompt, (k, v), form="rope", position_independent=False)
        assert report.failed == 0, report
        failed: list[int] = []

        def fetch() -> None:
            plan = client.lookup(prompt, allow_position_independent=False)
            assert plan.prefix_end == tokens, plan
            failed.append(len(client.fetch(plan, prompt, into=into).failed))

        seconds = best_of(reps, fetch)
        if path == "samehost":
            shm = client.core.shm
            assert shm is not None
            stats = shm.stats()
            # Every block came straight from the pool (none copied by a fallback path).
            assert stats.copied_blocks == 0 and stats.leased_blocks > 0, stats
    assert failed == [0] * len(failed), "blocks failed to fetch"
    for caches, want in ((into.k_caches, k), (into.v_caches, v)):
        assert caches is not None
        page = caches[-1].view(-1, model.heads, model.dim)[into.slot_mapping]
        assert torch.equal(page, want[-1]), "the paged cache does not hold the stored KV"
    return seconds


def put_seconds(model: Model, address: str, path: str, kv: KV, reps: int) -> float:
    """Best store of ``kv`` as fresh blocks over ``path`` ("net" or "grpc"; a new
    namespace per run)."""
    prompt, k, v = kv
    tokens = prompt.numel()
    runs = iter(range(reps + 1))
    with model.client(address, path, "put") as client:

        def store() -> None:
            report = client.store(
                prompt,
                (k, v),
                form="rope",
                namespace=f"put-{path}-{model.name}-{tokens}-{next(runs)}",
                position_independent=False,
            )
            assert report.failed == 0 and report.stored == tokens // PREFIX_BLOCK, report

        return best_of(reps, store)


def cold_child(address: str) -> None:
    """Child process: the first lookup + fetch of a fresh client, then warm ones (JSON)."""
    model = Model(COLD_SHAPE, *SHAPES[COLD_SHAPE])
    prompt, k, _ = model.kv(COLD_TOKENS, seed=COLD_TOKENS)
    into = paged_target(COLD_TOKENS, model.layers, model.heads, model.dim, DTYPE)
    with model.client(address, "auto", "cold") as client:
        times = []
        for _ in range(6):
            start = time.perf_counter()
            plan = client.lookup(prompt, allow_position_independent=False)
            result = client.fetch(plan, prompt, into=into)
            times.append(time.perf_counter() - start)
            assert plan.prefix_end == COLD_TOKENS and not result.failed
    page = into.k_caches[0].view(-1, model.heads, model.dim)[into.slot_mapping]
    assert torch.equal(page, k[0])
    print(json.dumps({"cold": times[0], "warm": min(times[1:])}))


def measure(model: Model, addr: str, tokens: int, reps: int) -> dict[str, float]:
    """GB/s of every path for one case (and its payload MiB), paths interleaved per case
    so that each ratio compares runs made within seconds of each other."""
    kv = model.kv(tokens, seed=tokens)
    nbytes = model.layers * model.heads * model.dim * 2 * 2 * tokens
    into = paged_target(tokens, model.layers, model.heads, model.dim, DTYPE)
    seconds: dict[str, Callable[[], float]] = {
        "tcp": lambda: tcp_seconds(nbytes, reps),
        "memcpy": lambda: memcpy_seconds(nbytes, reps),
        "net": lambda: fetch_seconds(model, addr, "net", kv, into, reps),
        "net4": lambda: fetch_seconds(model, addr, "net4", kv, into, reps),
        "samehost": lambda: fetch_seconds(model, addr, "samehost", kv, into, reps),
        "grpc": lambda: fetch_seconds(model, addr, "grpc", kv, into, reps),
        "put": lambda: put_seconds(model, addr, "net", kv, reps),
        "putgrpc": lambda: put_seconds(model, addr, "grpc", kv, reps),
    }
    row = {name: nbytes / run() / 1e9 for name, run in seconds.items()}
    row["mib"] = nbytes / 2**20
    return row


def geomean(values: list[float]) -> float:
    """Geometric mean."""
    return math.exp(sum(math.log(x) for x in values) / len(values))


def breakeven(gbps: float) -> float:
    """The Llama-3-8B prefill rate (tokens/s) a fetch at ``gbps`` breaks even with."""
    return gbps * 1e9 / LLAMA_BYTES_PER_TOKEN


def main() -> None:
    """Run every case and print the RESULT line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: small cases of both shapes, one pass"
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=max(SIZES),
        help="skip the cases above this many tokens (a full run needs ~10 GiB of memory)",
    )
    parser.add_argument("--cold-child", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cold_child:
        cold_child(args.cold_child)
        return
    models = [Model(name, *shape) for name, shape in SHAPES.items()]
    sizes: dict[str, tuple[int, ...]] = {m.name: SIZES for m in models}
    if args.quick:
        args.reps = 1
        sizes = dict(QUICK_SIZES)
    if args.max_tokens < min(min(v) for v in sizes.values()):
        parser.error(f"--max-tokens: {args.max_tokens} leaves no case")
    sizes = {name: tuple(n for n in ns if n <= args.max_tokens) for name, ns in sizes.items()}
    cases = [(m, n) for m in models for n in sizes[m.name]]
    largest = max(m.layers * m.heads * m.dim * 2 * 2 * n for m, n in cases)
    largest_block = max(m.layers * m.heads * m.dim * 2 * 2 * PREFIX_BLOCK for m, _ in cases)
    # Room for one case's blocks and headers: each case stores its blocks before its
    # fetches (the put runs' fresh blocks then push them out); no more, since a 16k-token
    # Llama-3-8B case is 2 GiB and the pool's pages stay resident once written. At least
    # eight of the largest blocks, so that the default zero-copy share (a quarter of the
    # pool) holds two: a same-host fetch larger than the share is leased in rounds, as
    # placed blocks release theirs, like on a server whose pool is shared.
    capacity = f"{math.ceil(max(largest * 1.5, 8 * largest_block) / 2**20)}MiB"
    print(f"torch threads {torch.get_num_threads()}; server capacity {capacity}")
    print(
        f"{'case':>16} {'MiB':>6} {'tcp':>6} {'net':>6} {'net4':>6} {'memcpy':>7} {'samehost':>8} "
        f"{'grpc':>6} {'put':>6} {'putgrpc':>7}   GB/s   {'be_net':>7} {'be_same':>7} tok/s"
    )
    rows: dict[tuple[str, int], dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp, cache_server(capacity, Path(tmp) / "s.log") as addr:
        for model, tokens in cases:
            row = measure(model, addr, tokens, args.reps)
            rows[model.name, tokens] = row
            be = (
                f"{breakeven(row['net']):7.0f} {breakeven(row['samehost']):7.0f}"
                if model.name == BREAKEVEN_SHAPE
                else f"{'-':>7} {'-':>7}"
            )
            print(
                f"{model.name + ' ' + str(tokens):>16} {row['mib']:6.1f} "
                f"{row['tcp']:6.2f} {row['net']:6.2f} {row['net4']:6.2f} {row['memcpy']:7.2f} "
                f"{row['samehost']:8.2f} {row['grpc']:6.2f} {row['put']:6.2f} "
                f"{row['putgrpc']:7.2f}          {be}",
                flush=True,
            )
        # The child's blocks, stored just before it starts (earlier puts may have pushed
        # the fetch cases' blocks out of the tier).
        cold_model = Model(COLD_SHAPE, *SHAPES[COLD_SHAPE])
        prompt, k, v = cold_model.kv(COLD_TOKENS, seed=COLD_TOKENS)
        with cold_model.client(addr, "grpc", "cold") as client:
            client.store(prompt, (k, v), form="rope", position_independent=False)
        child = subprocess.run(
            [sys.executable, __file__, "--cold-child", addr], capture_output=True, text=True
        )
        if child.returncode:
            raise RuntimeError(f"cold-start child failed: {child.stderr[-3000:]}")
    cold = json.loads(child.stdout.strip().splitlines()[-1])
    cold_vs_warm = cold["cold"] / cold["warm"]
    print(
        f"cold start ({COLD_SHAPE} {COLD_TOKENS} tokens, new process): first lookup + fetch "
        f"{cold['cold'] * 1e3:.1f} ms, warm {cold['warm'] * 1e3:.1f} ms"
    )
    all_rows = list(rows.values())
    llama = [r for (name, _), r in rows.items() if name == BREAKEVEN_SHAPE]
    mean = {key: geomean([r[key] for r in all_rows]) for key in all_rows[0]}
    fetch_vs_tcp = geomean([r["net"] / r["tcp"] for r in all_rows])
    grpc_vs_tcp = geomean([r["grpc"] / r["tcp"] for r in all_rows])
    put_vs_tcp = geomean([r["put"] / r["tcp"] for r in all_rows])
    samehost_vs_memcpy = geomean([r["samehost"] / r["memcpy"] for r in all_rows])
    scaling = (
        min(
            rows[m.name, sizes[m.name][-1]]["net"] / rows[m.name, sizes[m.name][-2]]["net"]
            for m in models
            if len(sizes[m.name]) > 1
        )
        if any(len(v) > 1 for v in sizes.values())
        else math.nan
    )
    # Four streams split a Get only when it has several blocks (256 tokens each).
    multi = [r["net4"] / r["net"] for (_, n), r in rows.items() if n > PREFIX_BLOCK]
    streams4_vs_1 = geomean(multi) if multi else float("nan")
    be_same = geomean([breakeven(r["samehost"]) for r in llama])
    be_net = geomean([breakeven(r["net"]) for r in llama])
    print(
        f"RESULT tcp_gbps={mean['tcp']:.3f} fetch_gbps={mean['net']:.3f} "
        f"fetch_vs_tcp={fetch_vs_tcp:.3f} fetch_scaling={scaling:.3f} "
        f"streams4_vs_1={streams4_vs_1:.3f} "
        f"samehost_gbps={mean['samehost']:.3f} samehost_vs_memcpy={samehost_vs_memcpy:.3f} "
        f"cold_vs_warm={cold_vs_warm:.3f} put_gbps={mean['put']:.3f} put_vs_tcp={put_vs_tcp:.3f} "
        f"put_grpc_gbps={mean['putgrpc']:.3f} grpc_gbps={mean['grpc']:.3f} "
        f"grpc_vs_tcp={grpc_vs_tcp:.3f} breakeven_samehost_tok_s={be_same:.0f} "
        f"breakeven_net_tok_s={be_net:.0f}"
    )


if __name__ == "__main__":
    main()
