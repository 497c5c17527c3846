"""An agent fleet's trace replayed through the real client and a real server at a fixed
memory budget, for ``bench/capacity.py``.

The trace. ``bench/_traces.py``'s four situations (SmolLM2's tokenizer), cut into sessions
(the requests of one chat, one agent, one uploaded report: those that open with the same
message), copied for ``fleets`` tenants of the same shape (each copy's token ids moved
into its own range, so copies share nothing), and interleaved the way a fleet's traffic
arrives: every session takes its next turn once per round. A session's next turn reuses
its history, but only after every other session has taken a turn: reuse distances are a
round's traffic, which is what outgrows a memory tier.

The replay. For each request, in order: ``lookup`` then ``fetch`` through a
``CacheClient`` (cost model off, so every found block is fetched); the request's hit is
the tokens the fetch placed (a block found by the lookup and evicted before its Get counts
as a miss); then the whole prompt is stored as the vLLM connector stores it (exact-prefix
blocks and position-independent chunks per message). K and V are seeded random values of
a small model shape (``SHAPE``): the bytes and the keys are what a capacity run measures.

The budget: a dry run with unbounded memory measures the trace's working set (the bytes of
every block stored, as the server holds them); the CPU tier then gets a quarter of that
(``budget_share``), alone, or above a disk tier that holds all of it, with the client
storing the engine's dtype or fp8 (``kv_codec=fp8``: the same budget then holds twice the
tokens).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from _traces import SITUATIONS, Request, build_trace
from hitrate import Tokenizer

from nopecache.client import CacheClient, ClientConfig, ModelFingerprint
from nopecache.client.config import RetryPolicy
from nopecache.client.cost import CostConfig
from nopecache.kernels import RopeSpec
from nopecache.proto.block import StoredForm
from tests.support.redis_procs import free_ports
from tests.support.server_procs import CacheServerProc

# layers, KV heads, head_dim: 1 KiB of bf16 K and V per token (a tiny model's KV; a real
# one scales every byte count by the same factor and leaves every hit rate as it is).
SHAPE = (2, 2, 64)
DTYPE = torch.bfloat16
PREFIX_BLOCK = 16  # vLLM's block size
VOCAB = 49152  # SmolLM2's: each fleet copy's ids are moved by this much
# Small pages: the budget is in block bytes, and a page is at most the waste of a block
# (16 KiB exact-prefix blocks here; the disk tier's smallest page is its header probe).
CPU_PAGE = "1KiB"
DISK_PAGE = 4096
HANG_S = 600.0  # client deadlines: only hang guards on a loaded machine


@dataclass(frozen=True, slots=True)
class TracePrompt:
    """A request of the replay: token ids and where each message starts."""

    session: str
    tokens: np.ndarray
    segments: list[int]


@dataclass(frozen=True, slots=True)
class Replay:
    """What one replay measured."""

    prompt_tokens: int
    hit_tokens: int
    stored_bytes: int  # bytes of the blocks newly stored (as sent: header and payload)
    seconds: float

    @property
    def hit_rate(self) -> float:
        """Hit tokens over prompt tokens."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def sessions(requests: Sequence[Request], situation: str) -> dict[str, list[Request]]:
    """The requests of a situation by session: those opening with the same message."""
    out: dict[str, list[Request]] = {}
    for req in requests:
        out.setdefault(f"{situation}:{req.segments[0].text[:80]}", []).append(req)
    return out


def fleet_trace(seed: int, fleets: int, max_sessions: int = 0) -> list[TracePrompt]:
    """The interleaved trace of ``fleets`` tenants (module docstring); ``max_sessions``:
    keep only the first sessions of each tenant (0: all)."""
    tok = Tokenizer()
    by_session: dict[str, list[Request]] = {}
    for situation, requests in build_trace(seed, tok.count).items():
        assert situation in SITUATIONS
        by_session.update(sessions(requests, situation))
    names = list(by_session)[: max_sessions or None]
    tokenized = {n: [tok.request(r) for r in by_session[n]] for n in names}
    queues = [
        [
            TracePrompt(f"{f}/{n}", tokens.astype(np.int64) + f * VOCAB, starts)
            for tokens, starts in tokenized[n]
        ]
        for f in range(fleets)
        for n in names
    ]
    out: list[TracePrompt] = []
    for turn in range(max(len(q) for q in queues)):
        out += [q[turn] for q in queues if turn < len(q)]
    return out


def _fingerprint() -> tuple[ModelFingerprint, RopeSpec]:
    layers, heads, dim = SHAPE
    rope = RopeSpec.default(dim)
    fp = ModelFingerprint.from_rope_spec(
        model="capacity-bench",
        revision="",
        num_layers=layers,
        num_kv_heads=heads,
        dtype=DTYPE,
        form=StoredForm.ROPE,
        rope=rope,
    )
    return fp, rope


def _kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    layers, heads, dim = SHAPE
    g = torch.Generator().manual_seed(seed)
    shape = (layers, n, heads, dim)
    return (torch.randn(shape, generator=g).to(DTYPE), torch.randn(shape, generator=g).to(DTYPE))


@contextmanager
def server(workdir: Path, cpu_bytes: int, disk_bytes: int) -> Iterator[str]:
    """A real server process: a CPU tier of ``cpu_bytes``, above a disk tier of
    ``disk_bytes`` (0: none); its address while it runs."""
    tiers = [f"cpu://?capacity={cpu_bytes}&page={CPU_PAGE}&pinned=no"]
    if disk_bytes:
        disk = -(-disk_bytes // DISK_PAGE) * DISK_PAGE
        tiers.append(f"file://{workdir / 'disk'}?capacity={disk}&page={DISK_PAGE}")
    proc = CacheServerProc(workdir, free_ports(1)[0], tiers=tiers)
    proc.start()
    try:
        yield proc.address
    finally:
        proc.kill()


def replay(address: str, trace: Sequence[TracePrompt], codec: str = "none") -> Replay:
    """Replay ``trace`` through a client of the server at ``address`` (module docstring)."""
    fp, rope = _fingerprint()
    config = ClientConfig(
        servers=(address,),
        prefix_block_tokens=PREFIX_BLOCK,
        cost=CostConfig(enabled=False),
        retry=RetryPolicy(max_attempts=1),
        lookup_timeout_s=HANG_S,
        get_timeout_s=HANG_S,
        put_timeout_s=HANG_S,
        kv_codec=codec,  # type: ignore[arg-type]
    )
    began = time.perf_counter()
    prompt_tokens = hit_tokens = stored = 0
    with CacheClient(config, fingerprint=fp, rope=rope, v_head_dim=SHAPE[2]) as client:
        for i, p in enumerate(trace):
            tokens = torch.from_numpy(p.tokens)
            plan = client.lookup(tokens, segments=p.segments)
            if plan.hits or plan.prefix_end:
                result = client.fetch(plan, tokens)
                hit_tokens += int(result.mask.sum())
            prompt_tokens += len(tokens)
            report = client.store(tokens, _kv(len(tokens), i), 0, form="rope", segments=p.segments)
            stored += report.nbytes
    return Replay(prompt_tokens, hit_tokens, stored, time.perf_counter() - began)
