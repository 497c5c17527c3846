"""Position-independent hits against exact-prefix hits: fetch and placement MB/s, one run.

What vLLM's connector does per load in blend mode against prefix mode, without an engine:
``CacheClient.fetch(plan, prompt, into=PagedKV)`` from a real server (a
``python -m nopecache.cache_server`` child, CPU tier, on loopback; the client's default
transport) into vLLM's CPU attention pages (``CpuAttnLayout``: per layer ``[blocks,
kv_heads, block_size, 2 * head_dim]``, K transposed, a shuffled block table), shaped like
SmolLM2-135M (30 layers, 3 KV heads, head_dim 64, bf16, rope theta 100000).

A conversation of chat messages (each starting with one segment token, as the connector's
``segment_token_ids`` cut them) is stored once, as vLLM's connector stores it: post-RoPE K
at positions ``0..`` (``form="rope"``), exact-prefix blocks of ``--block-size`` tokens (the
connector's prefix blocks are vLLM's blocks) and position-independent blocks (nope K,
content-chunked from each message's start). Two fetches of the same conversation are then
timed, rounds interleaved (exact, PI, exact, PI, ...):

    exact   the conversation as the prompt: every hit an exact-prefix block at its own
            positions (placement copies K, bit exact)
    pi      the conversation behind a new first message of ``--shift`` tokens: no exact
            prefix, every hit position-independent and rotated to its new positions (the
            first message is not fetched: slot -1, as a connector's unclaimed positions)

MB/s = 10^6 block bytes received (the fetch result's ``nbytes``, what the connector's
``fetched_bytes`` counts) per second of ``fetch`` (what its ``fetch_seconds`` times), best
of ``--rounds``. ``--profile`` prints cProfile's top functions of the PI fetches.

Last line: ``RESULT pi_place_mb_s=... exact_place_mb_s=... pi_vs_exact=...``: the two rates
and PI's over exact's (issue 33's target: PI within 1.5x of exact, pi_vs_exact >= 0.67).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _harness import cache_server

from nopecache.client import CacheClient, ClientConfig, ModelFingerprint, PagedKV
from nopecache.client.cost import CostConfig
from nopecache.client.fetching import BlockPlacer, FetchResult
from nopecache.client.plan import HitKind, ReusePlan
from nopecache.integrations.vllm.layout import CpuAttnLayout
from nopecache.kernels import RopeSpec
from nopecache.proto.block import StoredForm

# The RESULT line's keys, in order: tests/bench/test_quick.py checks a --quick run
# prints exactly these.
RESULT_KEYS = ("pi_place_mb_s", "exact_place_mb_s", "pi_vs_exact")

LAYERS, HEADS, DIM = 30, 3, 64  # SmolLM2-135M
DTYPE = torch.bfloat16
THETA = 100000.0
SEGMENT = 1  # SmolLM2's <|im_start|>
MESSAGE_TOKENS = (96, 160, 240, 72, 200, 128, 300, 180)  # lengths of the stored messages


def fingerprint(rope: RopeSpec) -> ModelFingerprint:
    """Post-RoPE K, as vLLM holds it (exact-prefix blocks are ROPE, PI blocks nope)."""
    return ModelFingerprint.from_rope_spec(
        model="smollm2-135m-shaped",
        revision="bench",
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        dtype=DTYPE,
        form=StoredForm.ROPE,
        rope=rope,
    )


def conversation(messages: int, seed: int) -> torch.Tensor:
    """Token ids of ``messages`` chat messages, each starting with the segment token."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for i in range(messages):
        body = torch.randint(2, 49000, (MESSAGE_TOKENS[i % len(MESSAGE_TOKENS)] - 1,), generator=g)
        parts.append(torch.cat((torch.tensor([SEGMENT]), body)))
    return torch.cat(parts)


def segments(prompt: torch.Tensor) -> list[int]:
    """Segment starts: every segment token (the connector's ``segment_token_ids``)."""
    return [int(i) for i in (prompt == SEGMENT).nonzero().flatten()]


def random_kv(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[layers, tokens, heads, dim]``: random bf16 bit patterns of finite values."""
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, tokens, HEADS, DIM)
    k, v = (
        torch.randint(0, 0x3F00, shape, generator=g, dtype=torch.int16).view(DTYPE)
        for _ in range(2)
    )
    return k, v


def cpu_pages(tokens: int, block_size: int, skip: int) -> PagedKV:
    """vLLM CPU attention pages for ``tokens`` (25% spare, shuffled), the first ``skip``
    positions not written (slot -1)."""
    need = -(-tokens // block_size)
    blocks = need * 5 // 4 + 1
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(1))[:need]
    slots = (table[:, None] * block_size + torch.arange(block_size)[None, :]).reshape(-1)
    slots = slots[:tokens].to(torch.int64).clone()
    slots[:skip] = -1
    layout = CpuAttnLayout(block_size, HEADS, DIM)
    caches = [torch.zeros((blocks, HEADS, block_size, 2 * DIM), dtype=DTYPE) for _ in range(LAYERS)]
    return layout.paged(caches, slots)


class Mode:
    """One fetch to time: a prompt, its plan, and the pages it lands in."""

    def __init__(self, client: CacheClient, prompt: torch.Tensor, into: PagedKV, pi: bool):
        self.client, self.prompt, self.into = client, prompt, into
        self.plan: ReusePlan = client.lookup(
            prompt, segments=segments(prompt), allow_position_independent=pi
        )
        kinds = {h.kind for h in self.plan.blocks}
        want = HitKind.POSITION_INDEPENDENT if pi else HitKind.PREFIX
        assert kinds == {want}, f"expected only {want.name} hits, got {kinds}"
        self.best = float("inf")
        self.nbytes = 0
        self.tokens = 0

    def run(self) -> FetchResult:
        """One timed fetch; keeps the best time."""
        start = time.perf_counter()
        result = self.client.fetch(self.plan, self.prompt, into=self.into)
        seconds = time.perf_counter() - start
        assert not result.failed, f"{len(result.failed)} hits failed"
        self.best = min(self.best, seconds)
        self.nbytes, self.tokens = result.nbytes, result.placed_tokens
        return result

    @property
    def mb_s(self) -> float:
        """Best MB/s."""
        return self.nbytes / self.best / 1e6


def check_v(mode: Mode, v: torch.Tensor, offset: int) -> None:
    """V of every placed hit is in its pages, bit exact (K is checked by the kernel tests)."""
    layout = CpuAttnLayout(mode.into.k_caches[0].shape[1], HEADS, DIM)
    assert mode.into.v_caches is not None
    for hit in mode.plan.blocks:
        slots = mode.into.slot_mapping[hit.target.start : hit.target.end]
        got = mode.into.v_caches[-1][slots // layout.block_size, slots % layout.block_size]
        want = v[-1, hit.target.start - offset : hit.target.end - offset]
        assert torch.equal(got, want), f"V of {hit} differs"


class Profiled:
    """A mode's ``run`` with block placement (the client's worker thread) under cProfile."""

    def __init__(self, mode: Mode, profiler: cProfile.Profile) -> None:
        self.mode, self.profiler = mode, profiler

    def __call__(self) -> FetchResult:
        """``mode.run()``, every ``BlockPlacer.place_many`` call of it profiled."""
        place = BlockPlacer.place_many
        profiler = self.profiler

        def traced(*args: Any) -> list[bool]:
            return list(profiler.runcall(place, *args))

        setattr(BlockPlacer, "place_many", traced)  # noqa: B010 (a method, patched for a run)
        try:
            return self.mode.run()
        finally:
            setattr(BlockPlacer, "place_many", place)  # noqa: B010


def measure(client: CacheClient, args: argparse.Namespace) -> tuple[Mode, Mode]:
    """Store the conversation, then time both fetches, rounds interleaved (best of each)."""
    stored = conversation(args.messages, seed=3)
    tokens = stored.numel()
    # A new first message of its own: no exact prefix matches anything after it.
    shifted = torch.cat((torch.tensor([SEGMENT]), torch.arange(2, args.shift + 1), stored))
    offset = shifted.numel() - tokens
    k, v = random_kv(tokens, seed=5)
    report = client.store(stored, (k, v), 0, form="rope", segments=segments(stored))
    assert report.failed == 0, report
    exact = Mode(client, stored, cpu_pages(tokens, args.block_size, 0), pi=False)
    pi = Mode(client, shifted, cpu_pages(shifted.numel(), args.block_size, offset), pi=True)
    profiler = cProfile.Profile() if args.profile else None
    runs: list[tuple[Mode, Callable[[], FetchResult]]] = [(m, m.run) for m in (exact, pi)]
    if profiler is not None:
        traced = pi if args.profile == "pi" else exact
        runs = [(m, Profiled(m, profiler) if m is traced else r) for m, r in runs]
    for mode, run in runs:  # warm-up, untimed
        run()
        mode.best = float("inf")
    for _ in range(args.rounds):
        for _, run in runs:
            run()
    check_v(exact, v, 0)
    check_v(pi, v, offset)
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue())
    return exact, pi


def main() -> None:
    """Run both modes against a fresh server and print the RESULT line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=16, help="chat messages stored")
    parser.add_argument("--shift", type=int, default=137, help="tokens of the new first message")
    parser.add_argument("--block-size", type=int, default=128, help="vLLM's (CPU: 128)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: as each vLLM engine of bench/vllm_serve.py runs)",
    )
    parser.add_argument(
        "--profile", choices=("pi", "exact"), help="cProfile one mode's placement (worker thread)"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: 4 messages, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.messages, args.rounds = 4, 2
    torch.set_num_threads(args.threads)
    rope = RopeSpec.default(DIM, THETA)
    tokens = sum(MESSAGE_TOKENS[i % len(MESSAGE_TOKENS)] for i in range(args.messages))
    nbytes = LAYERS * tokens * HEADS * DIM * 2 * 2
    print(
        f"SmolLM2 shape ({LAYERS} layers x {HEADS} KV heads x {DIM}, bf16), {args.messages} "
        f"messages = {tokens} tokens ({nbytes / 1e6:.1f} MB of K and V), block {args.block_size}, "
        f"shift {args.shift}; torch threads {torch.get_num_threads()}"
    )
    config = ClientConfig(
        servers=("127.0.0.1:1",),  # replaced below, once the server listens
        get_timeout_s=120.0,
        put_timeout_s=120.0,
        cost=CostConfig(enabled=False),
    )
    capacity = f"{max(64, 4 * nbytes // 2**20)}MiB"
    with tempfile.TemporaryDirectory() as tmp, cache_server(capacity, Path(tmp) / "s.log") as addr:
        client = CacheClient(
            dataclasses.replace(config, servers=(addr,)),
            fingerprint=fingerprint(rope),
            rope=rope,
            v_head_dim=DIM,
            prefix_block_tokens=args.block_size,
        )
        with client:
            exact, pi = measure(client, args)
    for name, mode in (("exact", exact), ("pi", pi)):
        blocks = len(mode.plan.blocks)
        print(
            f"{name:>5}: {blocks} blocks ({mode.tokens / blocks:.0f} tokens each), "
            f"{mode.nbytes / 1e6:.1f} MB in {mode.best * 1e3:.1f} ms: {mode.mb_s:.0f} MB/s"
        )
    print(
        f"RESULT pi_place_mb_s={pi.mb_s:.1f} exact_place_mb_s={exact.mb_s:.1f} "
        f"pi_vs_exact={pi.mb_s / exact.mb_s:.3f}"
    )


if __name__ == "__main__":
    main()
