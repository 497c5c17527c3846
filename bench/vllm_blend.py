"""Reuse at any position inside vLLM: blend mode against no cache and against prefix mode.

Run in the vLLM environment: ``.venv-vllm/bin/python bench/vllm_blend.py`` (``make bench``
does). One nopecache server (the embedded default, CPU tier) on loopback and four vLLM
processes (CPU build, SmolLM2-135M, bf16, one OpenMP thread each, vLLM's own prefix cache
off, so every hit comes through the connector):

    store   connector in prefix mode: answers each shape's stored prompt, stores its KV
    blend   ``pi_reuse="blend"`` (``--policy``, ``--budget``), save off: the engine measured
    prefix  ``pi_reuse="off"``, save off: prefix mode on the same prompts
    ref     no connector: vLLM without the cache

The four shapes (``bench/_blend_shapes.py``: truncated history, report before the system
prompt, agents sharing a block behind different preambles, RAG documents reordered), each
in turn:

1. ``store`` answers the shape's stored prompt; the server's entry count settles.
2. TTFT on the first question: ``--rounds`` rounds of ``ref`` then ``blend``
   (``max_tokens=1``; blend's time holds lookup, fetch, placement and its recompute loop),
   medians; ``prefix`` once. The connector's counters around blend's first request give
   the tokens reused (exact + position-independent) and the token-layers recomputed.
3. Quality on every question: ``ref``'s greedy answer (``MAX_ANSWER`` tokens) is the
   continuation; ``ref``'s prompt logprobs over prompt + answer are the reference, and
   ``blend``'s and ``prefix``'s over the same tokens, read through the connector
   (``skip_reading_prefix_cache=False``), give KL (over the reference's top ``TOP``) and
   top-1 agreement at every answer position. ``blend``'s own greedy answer is checked
   for the expected fact.

Summary: TTFT speed-up is the geometric mean over shapes of ref / blend; reused shares are
token-weighted over shapes (reused / prompt tokens); recompute is recomputed / reused
position-independent token-layers; top-1 and KL are means over all answer positions;
fact_kept is, of the questions whose no-cache answer holds the fact, the share whose blend
answer does too. ``--pi-reuse contiguous`` runs the same with the contiguous mode in
place of blend (no recompute) for comparison.

``--generation 2`` measures reuse of second-generation blocks: the storing engine runs
blend mode (default policy) and answers each stored prompt behind a lead-in and a primer
block it stored before, so the primer is reused at a new position and every stored
message's KV is computed attending to that approximate KV; a blend claim keeps such KV
under content keys only (issue 33), so the measured engines reuse it, never as an exact
prefix. The same line, against the default (first generation, each stored prompt
computed from scratch).

``--set report`` (or ``both``, the default) runs bench/quality.py's report half too, one
shape per prompt (``bench/_blend_report.py``: the context stored as an exact prefix, the
chunks on their own or inside an earlier request, each chunk a message), the same steps,
with a fact counted only where the no-cache answer holds it by ``FACT_MARGIN`` nats; a
per-kind table follows.

Last line: ``RESULT blend_ttft_speedup=... blend_reused=... blend_recompute=...
blend_top1=... blend_kl=... blend_fact_kept=... prefix_mode_reused=...
report_blend_ttft_speedup=... report_blend_recompute=... report_blend_top1=...
report_blend_kl=... report_blend_fact_kept=...``: the ``blend_*`` and ``prefix_*`` keys over
the four shapes, the ``report_*`` keys over the report half (NaN where a set did not run).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

from _blend_report import FACT_MARGIN, fact_margin, report_shapes  # noqa: E402
from _blend_shapes import SHAPES, Message, Shape, holds  # noqa: E402
from _demo_scenario import chat_prompt  # noqa: E402
from _vllm_measure import kl_top1  # noqa: E402
from _vllm_procs import Started, bench_processes  # noqa: E402

from nopecache.recompute.policies import DEFAULT_POLICY_NAME  # noqa: E402
from tests.support.engine_proc import EngineConfig, EngineProc  # noqa: E402
from tests.support.machine import core_for  # noqa: E402
from tests.support.redis_procs import free_ports  # noqa: E402
from tests.support.server_procs import CacheServerProc, wait_stored  # noqa: E402

# The RESULT line's keys, in order: tests/bench/test_quick.py checks a --quick run
# prints exactly these.
RESULT_KEYS = (
    "blend_ttft_speedup",
    "blend_reused",
    "blend_recompute",
    "blend_top1",
    "blend_kl",
    "blend_fact_kept",
    "prefix_mode_reused",
    "report_blend_ttft_speedup",
    "report_blend_recompute",
    "report_blend_top1",
    "report_blend_kl",
    "report_blend_fact_kept",
)

IM_START = 1  # SmolLM2's <|im_start|>: every chat message starts with it
MAX_ANSWER = 24
QUICK_ANSWER = 4  # answer tokens in --quick: enough for KL and top-1 at a few positions
TOP = 20
_COUNTERS = (
    "loaded_exact_tokens",
    "loaded_pi_tokens",
    "blend_claimed_tokens",
    "blend_miss_tokens",
    "pi_token_layers",
    "recomputed_token_layers",
    "blend_fallbacks",
)


@dataclass(slots=True)
class Quality:
    """Teacher-forced agreement with the reference over answer positions."""

    kls: list[float] = field(default_factory=list)
    hits: list[bool] = field(default_factory=list)

    def add(self, ref: list[Any], got: list[Any], answer: Sequence[int], start: int) -> None:
        """Fold in the positions ``start + j`` that predict ``answer[j]``."""
        for j, token in enumerate(answer):
            ref_lp, got_lp = ref[start + j], got[start + j]
            if ref_lp is None or got_lp is None:
                raise RuntimeError(f"no prompt logprobs at position {start + j}")
            kl, hit = kl_top1(ref_lp, got_lp, token)
            self.kls.append(kl)
            self.hits.append(hit)

    @property
    def kl(self) -> float:
        """Mean KL over the positions."""
        return statistics.fmean(self.kls) if self.kls else math.nan

    @property
    def top1(self) -> float:
        """Share of positions whose top token is the reference's."""
        return statistics.fmean(self.hits) if self.hits else math.nan


@dataclass(slots=True)
class ShapeResult:
    """What one shape measured."""

    name: str
    kind: str = ""
    prompt_tokens: int = 0
    ttft_ref: list[float] = field(default_factory=list)
    ttft_blend: list[float] = field(default_factory=list)
    claimed: list[int] = field(default_factory=list)  # tokens each blend round took
    ttft_prefix: float = 0.0
    blend: dict[str, float] = field(default_factory=dict)  # counter deltas, one request
    prefix: dict[str, float] = field(default_factory=dict)
    blend_quality: Quality = field(default_factory=Quality)
    prefix_quality: Quality = field(default_factory=Quality)
    facts_ref: int = 0  # questions whose no-cache answer holds the fact
    facts_kept: int = 0  # of those, the ones whose blend answer holds it too
    questions: int = 0
    answers: list[tuple[str, str, str]] = field(default_factory=list)  # question, ref, blend
    margins: list[float | None] = field(default_factory=list)  # fact margins (report set)

    @property
    def blend_reused(self) -> float:
        """Tokens blend took from the cache (exact + position-independent)."""
        return self.blend.get("loaded_exact_tokens", 0.0) + self.blend.get("loaded_pi_tokens", 0.0)

    @property
    def prefix_reused(self) -> float:
        """Tokens prefix mode took from the cache."""
        return self.prefix.get("loaded_exact_tokens", 0.0)

    @property
    def speedup(self) -> float:
        """Median TTFT without the cache over median TTFT with it."""
        return statistics.median(self.ttft_ref) / statistics.median(self.ttft_blend)


class Engines:
    """The four engines and the server they share (see the module docstring)."""

    def __init__(self, store: EngineProc, blend: EngineProc, prefix: EngineProc, ref: EngineProc):
        self.store, self.blend, self.prefix, self.ref = store, blend, prefix, ref

    def all(self) -> tuple[EngineProc, ...]:
        """Every engine."""
        return (self.store, self.blend, self.prefix, self.ref)


def _counters(engine: EngineProc) -> dict[str, float]:
    metrics = engine.metrics()
    return {name: metrics.get(f"vllm:nopecache_{name}", 0.0) for name in _COUNTERS}


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def _timed_with_counters(engine: EngineProc, prompt: list[int]) -> tuple[float, dict[str, float]]:
    before = _counters(engine)
    seconds = float(engine.generate(prompt, max_tokens=1)["seconds"])
    return seconds, _delta(before, _counters(engine))


def _through_connector(engine: EngineProc, prompt: list[int]) -> list[Any]:
    out = engine.generate(
        prompt, max_tokens=1, prompt_logprobs=TOP, skip_reading_prefix_cache=False
    )
    lps: list[Any] = out["prompt_logprobs"]
    return lps


def _store(engines: Engines, prompt: list[int], address: str, stored: set[tuple[int, ...]]) -> None:
    """The storing engine answers ``prompt``; returns once its KV landed (a prompt stored
    before adds no entry: skipped)."""
    if tuple(prompt) in stored:
        return
    entries = wait_stored(address, at_least=0, timeout_s=30)
    engines.store.generate(prompt, max_tokens=1)
    wait_stored(address, at_least=entries + 1)
    stored.add(tuple(prompt))


# --generation 2: every stored prompt is computed after this block, reused at a new
# position (a blend claim), so its own KV attended to approximate KV: a second generation.
PRIMER = " ".join(
    f"Weather note {i}: {['fog', 'gales', 'sleet', 'sunshine'][i % 4]} expected over "
    f"{['the north coast', 'the fjords', 'the plateau', 'the islands'][i % 4]} from "
    f"{6 + i}:00, visibility {2 + i % 5} km, sea state {i % 6}."
    for i in range(16)
)
PRIMER_LEAD = "Before my real question, some background."


def second_generation(messages: Sequence[Message]) -> tuple[Message, ...]:
    """``messages`` behind the primer and a lead-in: the prompt a blend engine answers to
    store the messages' KV as second-generation blocks (see ``--generation``)."""
    return (("user", PRIMER_LEAD), ("user", PRIMER), *messages)


def run_shape(
    shape: Shape,
    engines: Engines,
    ids: Any,
    address: str,
    rounds: int,
    max_answer: int,
    tokenizer: Any = None,
    stored: set[tuple[int, ...]] | None = None,
    generation: int = 1,
) -> ShapeResult:
    """Store, time and check one shape (steps 1-3 of the module docstring). With a
    ``tokenizer`` a fact counts only by ``FACT_MARGIN`` (``_blend_report.fact_margin``).
    ``generation`` 2: the stored prompts are stored second-generation (``--generation``)."""
    result = ShapeResult(shape.name, shape.kind)
    stored = set() if stored is None else stored
    for messages in (shape.stored, *shape.stored_more):
        if generation == 1:
            _store(engines, ids(messages), address, stored)
            continue
        _store(engines, ids((("user", PRIMER),)), address, stored)
        before = _counters(engines.store)
        _store(engines, ids(second_generation(messages)), address, stored)
        claimed = _delta(before, _counters(engines.store))["blend_claimed_tokens"]
        # Second generation only if the primer was reused (a blend claim before them).
        print(f"{shape.name}: stored behind a blend claim of {claimed:.0f} tokens", flush=True)
        if not claimed:
            raise RuntimeError(f"{shape.name}: the storing engine did not blend the primer")

    first = ids(shape.asking(shape.questions[0][0]))
    result.prompt_tokens = len(first)
    for r in range(rounds):
        result.ttft_ref.append(float(engines.ref.generate(first, max_tokens=1)["seconds"]))
        before = _counters(engines.blend) if r == 0 else {}
        out = engines.blend.generate(first, max_tokens=1)
        if r == 0:
            result.blend = _delta(before, _counters(engines.blend))
        result.ttft_blend.append(float(out["seconds"]))
        result.claimed.append(int(out["cached"]))
    result.ttft_prefix, result.prefix = _timed_with_counters(engines.prefix, first)

    for question, expected in shape.questions:
        prompt = ids(shape.asking(question))
        ref_answer = engines.ref.generate(prompt, max_tokens=max_answer)
        answer = list(ref_answer["ids"])
        forced = prompt + answer
        ref_lps = engines.ref.generate(forced, max_tokens=1, prompt_logprobs=TOP)
        result.blend_quality.add(
            ref_lps["prompt_logprobs"],
            _through_connector(engines.blend, forced),
            answer,
            len(prompt),
        )
        result.prefix_quality.add(
            ref_lps["prompt_logprobs"],
            _through_connector(engines.prefix, forced),
            answer,
            len(prompt),
        )
        blend_answer = engines.blend.generate(prompt, max_tokens=max_answer)
        result.questions += 1
        counted = holds(expected, ref_answer["text"])
        if tokenizer is not None:
            at = ref_lps["prompt_logprobs"][len(prompt) : len(prompt) + len(answer)]
            margin = fact_margin(tokenizer, answer, at, expected)
            result.margins.append(margin)
            counted = margin is not None and margin >= FACT_MARGIN
        if counted:
            result.facts_ref += 1
            result.facts_kept += holds(expected, blend_answer["text"])
        result.answers.append((question, ref_answer["text"], blend_answer["text"]))
    return result


def _start_all(configs: dict[str, EngineConfig], work: Path, started: Started) -> None:
    """Start the engines side by side (each start is ~30 s, much of it waiting on disk)."""
    for name, cfg in configs.items():
        started.engine(name, EngineProc(cfg, work / f"{name}.log")).launch()
    started.announce()
    for proc in started.engines.values():
        proc.wait_ready()
        # First requests allocate: keep them out of the numbers.
        proc.generate(proc.chat([{"role": "user", "content": "Hello!"}]), max_tokens=2)


def _ms(seconds: Sequence[float] | float) -> str:
    value = statistics.median(seconds) if isinstance(seconds, Sequence) else seconds
    return f"{value * 1e3:.0f}"


def print_table(results: list[ShapeResult], mode: str) -> None:
    """The per-shape table (markdown, as docs/results/vllm_blend.md shows it)."""
    print()
    print(
        f"| shape | prompt | {mode} reused | recompute | TTFT no cache | TTFT {mode} | speed-up "
        f"| prefix reused | TTFT prefix | top-1 | KL | prefix KL | facts |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        recompute = _share(
            r.blend.get("recomputed_token_layers", 0.0), r.blend.get("pi_token_layers", 0.0)
        )
        print(
            f"| {r.name} | {r.prompt_tokens} | {r.blend_reused:.0f} "
            f"({r.blend_reused / r.prompt_tokens:.0%}) | {recompute:.3f} | {_ms(r.ttft_ref)} ms "
            f"| {_ms(r.ttft_blend)} ms | {r.speedup:.2f}x | {r.prefix_reused:.0f} "
            f"({r.prefix_reused / r.prompt_tokens:.0%}) | {_ms(r.ttft_prefix)} ms "
            f"| {r.blend_quality.top1:.3f} | {r.blend_quality.kl:.4f} | {r.prefix_quality.kl:.4f} "
            f"| {r.facts_kept}/{r.facts_ref} of {r.questions} |"
        )
    print()
    for r in results:
        if len(set(r.claimed)) > 1:
            print(f"{r.name}: tokens claimed per TTFT round {r.claimed} (the cost model varied)")
        fallbacks = r.blend.get("blend_fallbacks", 0.0)
        if fallbacks:
            print(f"{r.name}: {fallbacks:.0f} blend fallbacks")
        for question, ref, got in r.answers:
            print(f"{r.name}: {question!r}\n  no cache: {ref!r}\n  {mode}: {got!r}")


def _share(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def summary(results: list[ShapeResult]) -> dict[str, float]:
    """The RESULT line's values (see the module docstring); NaN for a set not run."""
    if not results:
        return dict.fromkeys(RESULT_KEYS[:7], math.nan)
    prompt = sum(r.prompt_tokens for r in results)
    quality = Quality()
    for r in results:
        quality.kls += r.blend_quality.kls
        quality.hits += r.blend_quality.hits
    facts_ref = sum(r.facts_ref for r in results)
    return {
        "blend_ttft_speedup": math.exp(statistics.fmean(math.log(r.speedup) for r in results)),
        "blend_reused": sum(r.blend_reused for r in results) / prompt,
        "blend_recompute": _share(
            sum(r.blend.get("recomputed_token_layers", 0.0) for r in results),
            sum(r.blend.get("pi_token_layers", 0.0) for r in results),
        ),
        "blend_top1": quality.top1,
        "blend_kl": quality.kl,
        "blend_fact_kept": _share(sum(r.facts_kept for r in results), facts_ref),
        "prefix_mode_reused": sum(r.prefix_reused for r in results) / prompt,
    }


def report_summary(results: list[ShapeResult]) -> dict[str, float]:
    """The RESULT line's ``report_*`` values: :func:`summary` over the report set."""
    whole = summary(results)
    return {key: whole[key.removeprefix("report_")] for key in RESULT_KEYS[7:]}


def print_kinds(results: list[ShapeResult]) -> None:
    """Per kind of the report set: prompts, reused share, TTFT speed-up, top-1, KL, facts."""
    print()
    print("| kind | prompts | reused | recompute | speed-up | top-1 | KL | prefix KL | facts |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for kind in dict.fromkeys(r.kind for r in results):
        rows = [r for r in results if r.kind == kind]
        s = summary(rows)
        prefix = Quality()
        for r in rows:
            prefix.kls += r.prefix_quality.kls
        print(
            f"| {kind} | {len(rows)} | {s['blend_reused']:.0%} | {s['blend_recompute']:.3f} "
            f"| {s['blend_ttft_speedup']:.2f}x | {s['blend_top1']:.3f} | {s['blend_kl']:.4f} "
            f"| {prefix.kl:.4f} | {sum(r.facts_kept for r in rows)}/"
            f"{sum(r.facts_ref for r in rows)} |"
        )
    print("facts per prompt (counted only by a clear margin in the no-cache answer):")
    for r in results:
        for margin in r.margins:
            note = "not in the answer" if margin is None else f"margin {margin:.2f} nats"
            print(f"  {r.name:24s} {note}: kept {r.facts_kept}/{r.facts_ref}")


def blend_extra(mode: str, policy: str, budget: float) -> dict[str, Any]:
    """The measured engine's extra config beyond url and segments."""
    extra: dict[str, Any] = {"pi_reuse": mode, "save": False}
    if mode == "blend":
        extra.update(recompute_policy=policy, recompute_budget=budget)
    return extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="vLLM model folder ($NOPECACHE_VLLM_MODEL)")
    parser.add_argument("--pi-reuse", choices=["blend", "contiguous"], default="blend")
    parser.add_argument(
        "--policy", default=DEFAULT_POLICY_NAME, help="recompute policy (blend mode)"
    )
    parser.add_argument("--budget", type=float, default=0.15, help="recompute budget (blend)")
    parser.add_argument("--rounds", type=int, default=3, help="TTFT rounds per shape")
    parser.add_argument(
        "--generation",
        type=int,
        choices=(1, 2),
        default=1,
        help="1: the storing engine computes each stored prompt from scratch; 2: it runs "
        "blend mode and answers each behind a primer it reuses at a new position, so the "
        "stored prompt's blocks are second-generation (computed attending to reused KV)",
    )
    parser.add_argument("--shapes", nargs="*", default=None, help="run only these shapes")
    parser.add_argument(
        "--set",
        choices=("shapes", "report", "both"),
        default="both",
        help="the four shapes, bench/quality.py's report half (one shape per prompt), or both",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run (make test): the shortest shape, its first question, one round, "
        f"{QUICK_ANSWER}-token answers",
    )
    args = parser.parse_args()

    model = args.model or os.environ.get("NOPECACHE_VLLM_MODEL")
    if not model:
        sys.exit("set NOPECACHE_VLLM_MODEL (make bench does) or pass --model")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)

    def ids(messages: Sequence[Message]) -> list[int]:
        return list(chat_prompt(tokenizer, [(role, role, text) for role, text in messages]).tokens)

    shapes = [make() for make in SHAPES] if args.set != "report" else []
    if args.shapes:
        shapes = [s for s in shapes if s.name in args.shapes]
    report = report_shapes() if args.set != "shapes" else []
    max_answer = MAX_ANSWER
    if args.quick:

        def size(s: Shape) -> int:
            return len(ids(s.stored)) + len(ids(s.asking("")))

        shapes = [replace(s, questions=s.questions[:1]) for s in shapes]
        shapes = [min(shapes, key=size)] if shapes else []
        report = [min(report, key=size)] if report else []
        args.rounds, max_answer = 1, QUICK_ANSWER
    work = Path(tempfile.mkdtemp(prefix="nopecache-vllm-blend-"))
    # Cores: the storing engine on the first, the three measured engines (their TTFTs are
    # compared) on the second, so they have the same share of the machine; they answer
    # one at a time (round robin over the allowed cores: one core on a 1-core machine).
    storing, measured = core_for(0), core_for(1)
    with bench_processes(engines=4) as started:
        server = started.server(
            CacheServerProc(work, free_ports(1)[0], tiers=("cpu://?capacity=2GiB&pinned=no",))
        )
        url = f"nopecache://{server.address}"
        seg: dict[str, Any] = {"url": url, "segment_token_ids": [IM_START]}
        blend = {**seg, **blend_extra(args.pi_reuse, args.policy, args.budget)}
        # Generation 2: the storing engine blends too (the default policy, saving).
        store = seg if args.generation == 1 else {**seg, "pi_reuse": "blend"}
        configs = {
            "store": EngineConfig(model=model, connector=store, cpu=storing),
            "blend": EngineConfig(model=model, connector=blend, cpu=measured),
            "prefix": EngineConfig(
                model=model, connector={**seg, "pi_reuse": "off", "save": False}, cpu=measured
            ),
            "ref": EngineConfig(model=model, cpu=measured),
        }
        server.start()
        _start_all(configs, work, started)
        procs = started.engines
        engines = Engines(procs["store"], procs["blend"], procs["prefix"], procs["ref"])
        print(f"engines ready (logs in {work})", flush=True)
        stored: set[tuple[int, ...]] = set()
        results: list[ShapeResult] = []
        reported: list[ShapeResult] = []
        for shape in [*shapes, *report]:
            result = run_shape(
                shape,
                engines,
                ids,
                server.address,
                args.rounds,
                max_answer,
                tokenizer if shape.kind else None,
                stored,
                args.generation,
            )
            print(
                f"{shape.name}: {result.prompt_tokens} tokens, {args.pi_reuse} reused "
                f"{result.blend_reused:.0f}, prefix reused {result.prefix_reused:.0f}, TTFT "
                f"{_ms(result.ttft_ref)} -> {_ms(result.ttft_blend)} ms (claimed per round "
                f"{result.claimed})",
                flush=True,
            )
            (reported if shape.kind else results).append(result)
    if results:
        print_table(results, args.pi_reuse)
    if reported:
        print(f"\nreport half of bench/quality.py's set ({len(reported)} prompts):")
        print_table(reported, args.pi_reuse)
        print_kinds(reported)
    values = {**summary(results), **report_summary(reported)}
    fields = " ".join(f"{k}={values[k]:.4f}" for k in RESULT_KEYS)
    print(f"RESULT {fields}")


if __name__ == "__main__":
    main()
