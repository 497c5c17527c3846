"""Quality and speed of position-independent reuse with selective recompute, on SmolLM2-135M.

Each prompt of ``bench/_quality_prompts.py`` is ``context | chunk | question``; the chunk
(one chat message holding the fact the answer needs) was cached from an earlier request
where it came first (computed from position 0, or behind a one-token sink prefix), and
here it lands after ~250 tokens of unrelated context. That context is the conversation
so far, an exact-prefix hit (lossless, and it keeps each run short); the question is
the only miss. Everything runs through the real adapter
(``nopecache.client.adapters.hf``) with the in-process store, on the CPU.

For each recompute policy (and store option):

* ``recompute``: share of the chunk's token-layers recomputed (check layers included);
* ``KL``/``top1``: mean KL(full || reuse) and top-1 agreement of the next-token
  distributions over the answer, teacher-forced on the full prefill's greedy answer
  (pooled over all answer tokens of all prompts);
* ``gap``: share of the KL gap closed, ``1 - KL / KL(none)``, where ``none`` reuses the
  chunk as is (stored without a sink prefix);
* ``fact``: share of the prompts whose full-prefill answer holds the expected fact where
  the policy's greedy answer holds it too. Where the policy agrees with the full
  prefill's argmax at every answer step its greedy answer is the same token for token,
  so only the prompts where it does not are generated;
* ``1k time`` / ``speedup``: the prefill CPU time of the speed case below with this
  configuration, and the full prefill's time over it.

``exact``: the context and chunk stored as an exact prefix (nope K, re-rotated to the
same positions) must reproduce the full prefill: KL at fp32 rounding level.

Speed case: a ~1k-token chunk (the prompts' chunks joined into one document) reused
after a short system message (a new offset), prefill only (the KV is already fetched
and placed), against the model's own forward over the whole prompt
(``model(ids, logits_to_keep=1)``), same process; each of ``--repeat`` rounds runs the
baseline and every configuration once, and the minimum per configuration is kept (the
run least disturbed by other processes; the first round doubles as warm-up). Times are
the process's CPU time: all work runs on one thread, and CPU time is far less disturbed
by other processes on a shared machine than wall time (the default's wall-time
speed-up is printed too). No speed-up here comes from the exact prefix: only the
system message before the chunk is a miss.

Last line::

    RESULT exact_kl= none_top1= none_kl= firstk_top1= deviation_top1= deviation_kl=
           deviation_recompute= deviation_gap_recovered= best_gap_recovered_at_25=
           fact_kept= speedup=

``firstk`` is first_k(16), ``deviation`` is CacheBlend-style deviation(0.15) (K and V
distance at layer 1), ``best_gap_recovered_at_25`` the best configuration recomputing at
most 25% of the token-layers, ``fact_kept`` and ``speedup`` the default configuration's
(``recompute.DEFAULT_POLICY`` with the sink prefix). ``exact_kl`` is the largest mean
answer KL of any prompt.

Usage: ``python bench/quality.py [--threads N] [--repeat N] [--prompts N]``. Threads
default to 1: on a shared machine several OpenMP threads spin against other processes
and timings swing tenfold, while one thread per process stays stable.
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from _quality_prompts import PROMPTS, SYSTEM, QualityPrompt
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from nopecache.client.adapters import recompute as rc
from nopecache.client.adapters.hf import (
    NEWLINE_SINK,
    CapturedKV,
    HFEngine,
    InProcessStore,
    ReusedKV,
)
from nopecache.client.adapters.hf_forward import PrefillOutput
from nopecache.client.adapters.local_model import load_model, load_tokenizer
from nopecache.client.adapters.recompute import RecomputePolicy

MAX_ANSWER = 24
BUDGET = 0.25
SPEED_CHUNK_TOKENS = 1000


@dataclass(frozen=True, slots=True)
class Config:
    """A recompute policy and whether the chunk was stored behind the sink prefix."""

    policy: RecomputePolicy
    sink: bool = False

    @property
    def label(self) -> str:
        """Row label of the tables."""
        return self.policy.name + (" +sink" if self.sink else "")


BASELINE = Config(rc.none())
FIRST_K = Config(rc.first_k(16))
DEVIATION = Config(rc.deviation(0.15))
DEFAULT = Config(rc.DEFAULT_POLICY, sink=True)

CONFIGS: tuple[Config, ...] = (
    BASELINE,
    Config(rc.first_k(4)),
    FIRST_K,
    Config(rc.first_k(32)),
    Config(rc.deviation(0.05)),
    DEVIATION,
    Config(rc.deviation(0.30)),
    Config(rc.gradual([(1, 0.30), (2, 0.20), (4, 0.15)])),
    Config(rc.deviation(0.15, score="v")),
    Config(rc.blend(0.10, keep_first=8)),
    Config(rc.none(), sink=True),
    Config(rc.first_k(16), sink=True),
    Config(rc.first_k(24), sink=True),
    Config(rc.deviation(0.15), sink=True),
    Config(rc.blend(0.05, keep_first=8), sink=True),
    DEFAULT,
)


@dataclass(slots=True)
class Case:
    """One prompt, its full-prefill reference and its reusable chunk in both store forms."""

    prompt: QualityPrompt
    tokens: list[int]
    segments: list[int]
    answer: list[int]
    ref_logprobs: torch.Tensor  # [answer tokens, vocab]
    has_fact: bool
    prefix_kv: CapturedKV  # nope K and V of context and chunk, from the full prefill
    reused: dict[bool, ReusedKV] = field(default_factory=dict)


@dataclass(slots=True)
class Row:
    """Pooled measurements of one configuration over all cases."""

    config: Config
    kl: list[torch.Tensor] = field(default_factory=list)
    top1: list[torch.Tensor] = field(default_factory=list)
    fractions: list[float] = field(default_factory=list)
    facts: list[bool] = field(default_factory=list)

    @property
    def mean_kl(self) -> float:
        """Mean KL over every answer token of every prompt."""
        return float(torch.cat(self.kl).mean())

    @property
    def mean_top1(self) -> float:
        """Top-1 agreement over every answer token of every prompt."""
        return float(torch.cat(self.top1).float().mean())

    @property
    def fraction(self) -> float:
        """Mean share of the chunk's token-layers recomputed."""
        return sum(self.fractions) / len(self.fractions)

    @property
    def fact_kept(self) -> float:
        """Share of the prompts with the fact in the full answer that keep it."""
        return sum(self.facts) / len(self.facts) if self.facts else 1.0


def decode(tokenizer: PreTrainedTokenizerBase, tokens: list[int]) -> str:
    """Text of ``tokens``."""
    text = tokenizer.decode(tokens)
    assert isinstance(text, str)
    return text


def answer_logprobs(engine: HFEngine, prefill: PrefillOutput, answer: list[int]) -> torch.Tensor:
    """Log-probabilities ``[len(answer), vocab]`` predicting each answer token, teacher-forced."""
    return engine.continuation_logits(prefill, answer[:-1]).log_softmax(-1)


def build_case(
    engine: HFEngine,
    tokenizer: PreTrainedTokenizerBase,
    prompt: QualityPrompt,
    stop: Sequence[int],
    stores: dict[bool, InProcessStore],
) -> Case:
    """Full prefill and answer of one prompt; its context stored as an exact prefix, its
    chunk on its own (with and without the sink prefix); the reuse of both fetched."""
    context, chunk, question = prompt.segments(tokenizer)
    tokens = context + chunk + question
    segments = [len(context), len(context) + len(chunk)]
    full = engine.prefill(tokens, capture=True)
    captured = engine.captured(full)
    answer = engine.generate(full, MAX_ANSWER, stop)
    text = decode(tokenizer, answer)
    case = Case(
        prompt,
        tokens,
        segments,
        answer,
        answer_logprobs(engine, full, answer),
        prompt.expected.lower() in text.lower(),
        CapturedKV(captured.k_nope[:, : segments[1]], captured.v[:, : segments[1]]),
    )
    context_kv = CapturedKV(captured.k_nope[:, : len(context)], captured.v[:, : len(context)])
    for sink, store in stores.items():
        # The conversation so far is an exact-prefix hit (lossless; it keeps the runs
        # short); the chunk, cached from another request, is the approximate part.
        store.store(context, context_kv, position_independent=False)
        kv = engine.chunk_kv(chunk, sink_prefix=NEWLINE_SINK if sink else ())
        store.store(chunk, kv, prefix=False)
        reused = store.reuse(tokens, segments)
        assert reused is not None
        assert reused.layout.prefix_end == len(context)
        assert reused.layout.num_pi == len(chunk)
        case.reused[sink] = reused
    return case


def exact_prefix_kl(engine: HFEngine, case: Case) -> float:
    """Mean answer KL when context and chunk come back as an exact prefix."""
    store = InProcessStore(engine)
    cut = case.segments[1]
    store.store(case.tokens[:cut], case.prefix_kv, case.segments[:1], position_independent=False)
    reused = store.reuse(case.tokens, case.segments)
    assert reused is not None and reused.layout.prefix_end == cut
    logprobs = answer_logprobs(engine, engine.prefill(case.tokens, reused), case.answer)
    ref = case.ref_logprobs
    return float((ref.exp() * (ref - logprobs)).sum(-1).mean())


def measure(
    engine: HFEngine, tokenizer: PreTrainedTokenizerBase, case: Case, row: Row, stop: Sequence[int]
) -> None:
    """Add one case's measurements under ``row.config`` to ``row``."""
    cfg = row.config
    out = engine.prefill(case.tokens, case.reused[cfg.sink], cfg.policy)
    logprobs = answer_logprobs(engine, out, case.answer)
    ref = case.ref_logprobs
    row.kl.append((ref.exp() * (ref - logprobs)).sum(-1))
    agree = logprobs.argmax(-1) == ref.argmax(-1)
    row.top1.append(agree)
    row.fractions.append(out.recompute_fraction)
    if case.has_fact:
        if bool(agree.all()):
            row.facts.append(True)  # same argmax at every step: the same greedy answer
        else:
            text = decode(tokenizer, engine.generate(out, MAX_ANSWER, stop))
            row.facts.append(case.prompt.expected.lower() in text.lower())


def pareto(rows: Sequence[Row]) -> set[str]:
    """Labels of the rows no other row beats on both recompute share and KL."""
    front = set()
    for r in rows:
        if not any(
            o is not r
            and o.fraction <= r.fraction
            and o.mean_kl <= r.mean_kl
            and (o.fraction < r.fraction or o.mean_kl < r.mean_kl)
            for o in rows
        ):
            front.add(r.config.label)
    return front


def print_table(rows: Sequence[Row], baseline_kl: float, timing: Speed) -> None:
    """The policy table, sorted by recompute share (Pareto front marked ``*``)."""
    front = pareto(rows)
    print(
        f"{'configuration':30s} {'recompute':>9s} {'KL':>8s} {'top1':>6s} {'gap':>6s} "
        f"{'fact':>5s} {'1k time':>8s} {'speedup':>7s}"
    )
    for r in sorted(rows, key=lambda r: (r.fraction, r.mean_kl)):
        label = r.config.label
        mark = "*" if label in front else " "
        gap = 1.0 - r.mean_kl / baseline_kl
        seconds = timing.seconds[label]
        print(
            f"{mark}{label:29s} {r.fraction:9.3f} {r.mean_kl:8.4f} {r.mean_top1:6.3f} "
            f"{gap:6.3f} {r.fact_kept:5.2f} {seconds:7.3f}s {timing.full_s / seconds:6.2f}x"
        )
    print(
        "(* Pareto front of recompute vs KL. gap = 1 - KL / KL(none). 1k time: CPU time of "
        f"the prefill of the {timing.chunk_tokens}-token chunk case, best of runs; "
        f"full prefill {timing.full_s:.3f}s)"
    )


@dataclass(frozen=True, slots=True)
class Speed:
    """Prefill times for the ~1k-token chunk, full and per configuration (best of runs).

    ``full_s``/``seconds``: CPU time of this single-threaded process; ``*wall``: wall time.
    """

    chunk_tokens: int
    prompt_tokens: int
    full_s: float
    full_wall: float
    seconds: dict[str, float]
    wall: dict[str, float]
    fractions: dict[str, float]


def speed_prompt(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int], list[int]]:
    """System message, a ~1k-token document (the prompts' chunks joined), a question."""
    docs: list[str] = []
    for prompt in PROMPTS:
        docs.append(prompt.chunk)
        text = "Reference documents:\n\n" + "\n\n".join(docs)
        if len(tokenizer(text, add_special_tokens=False).input_ids) >= SPEED_CHUNK_TOKENS:
            break
    texts = (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n",
        f"<|im_start|>user\n{text}<|im_end|>\n",
        "<|im_start|>user\nWhich port does the server listen on?<|im_end|>\n"
        "<|im_start|>assistant\n",
    )
    system, chunk, question = (
        list(tokenizer(t, add_special_tokens=False).input_ids) for t in texts
    )
    return system, chunk, question


def speed(
    engine: HFEngine, tokenizer: PreTrainedTokenizerBase, configs: Sequence[Config], repeat: int
) -> Speed:
    """Full vs cached prefill time of every configuration, the chunk at a new offset.

    The baseline is the model's own forward over the whole prompt. Each round times the
    baseline and then every configuration once, so slow phases of a shared machine hit
    all of them alike; the minimum over rounds is kept. Times are CPU time of the process
    (one thread does all the work), which other processes disturb far less than wall
    time; wall times are kept too.
    """
    system, chunk, question = speed_prompt(tokenizer)
    tokens = system + chunk + question
    segments = [len(system), len(system) + len(chunk)]
    reused: dict[bool, ReusedKV] = {}
    for sink in (False, True):
        store = InProcessStore(engine)
        kv = engine.chunk_kv(chunk, sink_prefix=NEWLINE_SINK if sink else ())
        store.store(chunk, kv, prefix=False)
        found = store.reuse(tokens, segments)
        assert found is not None and found.layout.num_pi == len(chunk)
        reused[sink] = found
    ids = torch.tensor([tokens])
    runs: dict[str, Callable[[], object]] = {"full": lambda: engine.model(ids, logits_to_keep=1)}
    for cfg in configs:
        runs[cfg.label] = functools.partial(engine.prefill, tokens, reused[cfg.sink], cfg.policy)
    fractions: dict[str, float] = {}
    cpu = {label: math.inf for label in runs}
    wall = {label: math.inf for label in runs}
    for _ in range(repeat):
        for label, run in runs.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            out = run()
            cpu[label] = min(cpu[label], time.process_time() - start_cpu)
            wall[label] = min(wall[label], time.perf_counter() - start)
            if isinstance(out, PrefillOutput):
                fractions[label] = out.recompute_fraction
    full_s, full_wall = cpu.pop("full"), wall.pop("full")
    return Speed(len(chunk), len(tokens), full_s, full_wall, cpu, wall, fractions)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the benchmark and print the tables and the RESULT line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs for the speed-up")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="prompts to use")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    began = time.perf_counter()

    def progress(line: str) -> None:
        print(f"[{time.perf_counter() - began:6.1f}s] {line}", flush=True)

    tokenizer = load_tokenizer(progress=progress)
    engine = HFEngine(load_model(progress=progress), name="SmolLM2-135M-Instruct")
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]
    stores = {False: InProcessStore(engine), True: InProcessStore(engine)}
    cases = []
    for prompt in PROMPTS[: args.prompts]:
        cases.append(build_case(engine, tokenizer, prompt, stop, stores))
        c = cases[-1]
        progress(
            f"{prompt.name:14s} {len(c.tokens)} tokens, chunk [{c.segments[0]}, {c.segments[1]}), "
            f"answer {decode(tokenizer, c.answer)!r}"
        )
    exact = max(exact_prefix_kl(engine, c) for c in cases)
    progress(f"exact prefix reuse: max mean KL {exact:.2e}")

    rows = []
    for cfg in CONFIGS:
        row = Row(cfg)
        for case in cases:
            measure(engine, tokenizer, case, row, stop)
        rows.append(row)
        progress(f"{cfg.label:32s} recompute {row.fraction:.3f} KL {row.mean_kl:.4f}")

    timing = speed(engine, tokenizer, CONFIGS, args.repeat)
    progress(
        f"speed: {timing.chunk_tokens}-token chunk in a {timing.prompt_tokens}-token prompt: "
        f"full {timing.full_s:.3f}s CPU ({timing.full_wall:.3f}s wall), {DEFAULT.label} "
        f"{timing.seconds[DEFAULT.label]:.3f}s CPU ({timing.wall[DEFAULT.label]:.3f}s wall), "
        f"recompute {timing.fractions[DEFAULT.label]:.3f}"
    )

    by = {r.config.label: r for r in rows}
    base = by[BASELINE.label]
    print()
    print(
        f"{len(cases)} prompts, {sum(len(c.answer) for c in cases)} answer tokens, "
        f"facts in full answers: {sum(c.has_fact for c in cases)}/{len(cases)}"
    )
    print_table(rows, base.mean_kl, timing)
    within = [r for r in rows if r.fraction <= BUDGET]
    best = max(within, key=lambda r: 1.0 - r.mean_kl / base.mean_kl)
    print(f"best at <= {BUDGET:.0%} recompute: {best.config.label}")
    wall_speedup = timing.full_wall / timing.wall[DEFAULT.label]
    print(f"default {DEFAULT.label}: speed-up {wall_speedup:.2f}x in wall time")
    print(f"wall time {time.perf_counter() - began:.0f}s, {args.threads} thread(s)")
    dev, fk, default = by[DEVIATION.label], by[FIRST_K.label], by[DEFAULT.label]
    print(
        f"RESULT exact_kl={exact:.2e} none_top1={base.mean_top1:.4f} none_kl={base.mean_kl:.4f} "
        f"firstk_top1={fk.mean_top1:.4f} deviation_top1={dev.mean_top1:.4f} "
        f"deviation_kl={dev.mean_kl:.4f} deviation_recompute={dev.fraction:.4f} "
        f"deviation_gap_recovered={1.0 - dev.mean_kl / base.mean_kl:.4f} "
        f"best_gap_recovered_at_25={1.0 - best.mean_kl / base.mean_kl:.4f} "
        f"fact_kept={default.fact_kept:.4f} "
        f"speedup={timing.full_s / timing.seconds[DEFAULT.label]:.3f}"
    )


if __name__ == "__main__":
    main()
