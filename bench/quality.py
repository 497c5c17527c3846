"""Quality and speed of position-independent reuse at a set budget, on SmolLM2-135M.

Every prompt of ``bench/_quality_set.py`` (45 prompts, nine kinds, a tuning and a report
half) runs the path a user's engine runs: the KV it would have stored earlier goes
through the real ``CacheClient`` into a real cache server on loopback (``python -m
nopecache.cache_server``, CPU tier), cut into blocks by the client's own chunkers
(16-token exact-prefix blocks, ~64-token content chunks per segment); the prompt is
looked up and fetched back through the client and prefilled by the transformers adapter
(``nopecache.integrations.hf.adapter``) with each recompute policy. The context is an
exact-prefix hit, the chunks are position-independent hits, the question is a miss.

For each configuration (a policy, and the sink chunks cached on their own were computed
behind: none, ``+sink`` one newline token, ``+chat sink`` a short system message plus
the user header for raw text, ``+dialog sink`` the same with a generic exchange before
the header, see ``_quality_eval.SINKS``):

* ``recompute``: realised share of the reused token-layers recomputed (mean), and
  ``err``: the largest |realised - configured| of any prefill, in points;
* ``KL``/``top1``: mean KL(full || reuse) and top-1 agreement of the next-token
  distributions along the full prefill's greedy answer (teacher-forced, pooled over all
  answer tokens);
* ``gap``: share of the KL gap closed, ``1 - KL / KL(none)``, ``none`` reusing the chunks
  as stored without the sink;
* ``fact``: share of the prompts whose full-prefill answer holds the expected fact whose
  greedy answer under the configuration holds it too.

Per-kind gaps follow the table. ``exact``: context and chunks stored as an exact prefix
reproduce the full prefill (KL at fp32 rounding level).

Speed: a ~1k-token document (cached on its own, behind the dialog sink) after a system message,
then a question. ``full``: the model's own forward over the prompt. ``prefill``: the
adapter's prefill over KV already fetched. ``e2e``: lookup, fetch (gRPC to the server,
rotation, placement) and the prefill, through the client. Each of ``--repeat`` rounds
runs all three once and the minimum is kept; wall time for the ratios that cross
processes (e2e), and also CPU time of this single-threaded process for the prefill-only
ratio (other processes on a shared machine disturb it far less).

Last line::

    RESULT exact_kl= none_top1= none_kl= firstk_top1= deviation_top1= deviation_kl=
           deviation_recompute= deviation_gap_recovered= best_gap_recovered_at_25=
           fact_kept= speedup= report_gap_at_budget= report_fact_kept=
           budget_error_pp= e2e_speedup=

all on the report half: ``firstk`` is first_k(0.15), ``deviation`` deviation(0.15)
(CacheBlend-style, K and V distance at layer 1), ``best_gap_recovered_at_25`` the best
configuration recomputing at most 25%, ``fact_kept`` / ``report_fact_kept`` and
``report_gap_at_budget`` the default's (``recompute.DEFAULT_POLICY`` with the dialog sink),
``budget_error_pp`` the largest error of any budgeted prefill, ``speedup`` the
prefill-only CPU-time ratio and ``e2e_speedup`` the end-to-end wall-time ratio.

Usage: ``python bench/quality.py [--half report|tune|both] [--threads N] [--repeat N]
[--prompts N] [--no-speed]``. References (full prefills and their answers) are cached in
``bench/.cache/quality/``. Threads default to 1 (on a shared machine several OpenMP
threads spin against other processes).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from _harness import cache_server
from _quality_eval import (
    DIALOG_SINK,
    FACT_MARGIN,
    Case,
    Config,
    Row,
    build_case,
    encode,
    exact_prefix_kl,
    measure,
)
from _quality_prompts import SYSTEM
from _quality_set import FILLER, KINDS, PROMPTS, EvalPrompt, half
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from nopecache.client import CacheClient, ClientConfig
from nopecache.client.cost import CostConfig
from nopecache.integrations.hf.adapter import CacheClientSource, HFEngine
from nopecache.integrations.hf.forward import PrefillOutput
from nopecache.proto.block import StoredForm
from nopecache.recompute import policies as rc
from nopecache.recompute.question import question
from nopecache.recompute.relevance import relevance
from tests.support.local_model import load_model, load_tokenizer

# The RESULT line's keys, in order: tests/bench/test_quick.py checks a --quick run
# prints exactly these.
RESULT_KEYS = (
    "exact_kl",
    "none_top1",
    "none_kl",
    "firstk_top1",
    "deviation_top1",
    "deviation_kl",
    "deviation_recompute",
    "deviation_gap_recovered",
    "best_gap_recovered_at_25",
    "fact_kept",
    "speedup",
    "report_gap_at_budget",
    "report_fact_kept",
    "budget_error_pp",
    "e2e_speedup",
)

BUDGET = 0.15
MAX_SHARE = 0.25
SPEED_CHUNK_TOKENS = 1000
QUICK_SPEED_CHUNK_TOKENS = 200  # --quick: the speed case's document, a fifth of the size
PREFIX_BLOCK = 16  # vLLM's page size: exact-prefix blocks end close to the context's end

BASELINE = Config(rc.none())
FIRST_K = Config(rc.first_k(BUDGET))
DEVIATION = Config(rc.deviation(BUDGET))
DEFAULT = Config(rc.DEFAULT_POLICY, sink="dialog")

CONFIGS: tuple[Config, ...] = (
    BASELINE,
    Config(rc.none(), sink="newline"),
    Config(rc.none(), sink="chat"),
    Config(rc.none(), sink="dialog"),
    FIRST_K,
    Config(rc.first_k(BUDGET), sink="newline"),
    Config(rc.first_k(BUDGET), sink="chat"),
    DEFAULT,
    Config(rc.taper(BUDGET), sink="dialog"),
    DEVIATION,
    Config(rc.blend(BUDGET, 0.5), sink="dialog"),
    Config(question(BUDGET, 0.5), sink="dialog"),
    Config(question(BUDGET, 0.5, check_layer=0), sink="dialog"),
    Config(question(BUDGET, 0.0, prescan=True), sink="dialog"),
    Config(question(BUDGET, 0.5, prescan=True), sink="dialog"),
    Config(question(BUDGET, 0.5, prescan=True, heads="max"), sink="dialog"),
    Config(relevance(BUDGET, 0.5, "first"), sink="dialog"),
    Config(relevance(BUDGET, 0.25, "first"), sink="dialog"),
    Config(relevance(BUDGET, 0.5, "question"), sink="dialog"),
    Config(relevance(BUDGET, 0.25, "question"), sink="dialog"),
    Config(relevance(BUDGET, 0.75, "question"), sink="dialog"),
    Config(relevance(BUDGET, 0.5, "question", window=2), sink="dialog"),
    Config(relevance(BUDGET, 0.75, "question", window=1), sink="dialog"),
)


def print_table(rows: Sequence[Row], baseline: Row) -> None:
    """The policy table and the per-kind gaps, sorted by recompute share."""
    print(
        f"{'configuration':34s} {'recompute':>9s} {'err':>5s} {'KL':>8s} {'top1':>6s} "
        f"{'gap':>6s} {'fact':>5s}"
    )
    ordered = sorted(rows, key=lambda r: (r.fraction, r.mean_kl))
    for r in ordered:
        gap = 1.0 - r.mean_kl / baseline.mean_kl
        print(
            f" {r.config.label:33s} {r.fraction:9.3f} {r.max_error_pp:5.2f} {r.mean_kl:8.4f} "
            f"{r.mean_top1:6.3f} {gap:6.3f} {r.fact_kept:5.2f}"
        )
    for r in ordered:
        for lost in r.lost:
            print(f"  fact lost by {r.config.label}: {lost}")
    kinds = [k for k in KINDS if k in baseline.kinds]
    print("gap by kind (KL of none in the header row):")
    print(f" {'':33s} " + " ".join(f"{k[:8]:>8s}" for k in kinds))
    print(f" {'none KL':33s} " + " ".join(f"{baseline.kind_kl(k):8.4f}" for k in kinds))
    for r in ordered:
        gaps = [1.0 - r.kind_kl(k) / baseline.kind_kl(k) for k in kinds]
        print(f" {r.config.label:33s} " + " ".join(f"{g:8.3f}" for g in gaps))


@dataclass(frozen=True, slots=True)
class Speed:
    """Times for the ~1k-token chunk (best of rounds): full, prefill-only, end to end."""

    chunk_tokens: int
    prompt_tokens: int
    full_cpu: float
    full_wall: float
    prefill_cpu: float
    prefill_wall: float
    e2e_wall: float
    fraction: float


def speed_prompt(
    tokenizer: PreTrainedTokenizerBase, chunk_tokens: int = SPEED_CHUNK_TOKENS
) -> tuple[list[int], list[int], list[int]]:
    """System message, a ~1k-token document, a question about it."""
    facts = [p.chunks[0] for p in PROMPTS if p.kind in ("facts", "numbers", "similar")]
    paragraphs: list[str] = []
    for fact, filler in zip(facts, itertools.cycle(FILLER), strict=False):
        paragraphs += [fact, filler]
        text = "Reference documents:\n\n" + "\n\n".join(paragraphs)
        if len(encode(tokenizer, text)) >= chunk_tokens:
            break
    system = encode(tokenizer, f"<|im_start|>system\n{SYSTEM}<|im_end|>\n")
    chunk = encode(tokenizer, f"<|im_start|>user\n{text}<|im_end|>\n")
    question = encode(
        tokenizer,
        "<|im_start|>user\nWho designed the stone bridge over the Aller?<|im_end|>\n"
        "<|im_start|>assistant\n",
    )
    return system, chunk, question


def speed(
    engine: HFEngine,
    tokenizer: PreTrainedTokenizerBase,
    address: str,
    repeat: int,
    chunk_tokens: int = SPEED_CHUNK_TOKENS,
) -> Speed:
    """Full prefill vs cached prefill vs lookup + fetch + cached prefill (see module doc).

    The client here runs with its default cost model, told the full prefill's rate as an
    engine would (``observe_prefill``): it keeps a hit only while fetching it is faster.
    """
    system, chunk, question = speed_prompt(tokenizer, chunk_tokens)
    tokens = system + chunk + question
    segments = [len(system), len(system) + len(chunk)]
    ids = torch.tensor([tokens])
    config = ClientConfig(servers=(address,), prefix_block_tokens=PREFIX_BLOCK, namespace="speed")
    with make_client(engine, config) as client:
        source = CacheClientSource(client, wait=True)
        sink = encode(tokenizer, DIALOG_SINK)  # the chunk is a whole chat message
        source.store(chunk, engine.chunk_kv(chunk, sink_prefix=sink), prefix=False)
        fetched = source.reuse(tokens, segments)
        assert fetched is not None and fetched.layout.num_pi == len(chunk)
        policy = DEFAULT.policy

        def e2e() -> PrefillOutput:
            reused = source.reuse(tokens, segments)
            assert reused is not None and reused.layout.num_pi == len(chunk)
            return engine.prefill(tokens, reused, policy)

        runs: dict[str, Callable[[], object]] = {
            "full": lambda: engine.model(ids, logits_to_keep=1),
            "prefill": functools.partial(engine.prefill, tokens, fetched, policy),
            "e2e": e2e,
        }
        cpu = {label: math.inf for label in runs}
        wall = {label: math.inf for label in runs}
        fraction = 0.0
        for _ in range(repeat):
            for label, run in runs.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                out = run()
                cpu[label] = min(cpu[label], time.process_time() - start_cpu)
                wall[label] = min(wall[label], time.perf_counter() - start)
                if label == "full":
                    client.observe_prefill(len(tokens), time.perf_counter() - start)
                if isinstance(out, PrefillOutput):
                    fraction = out.recompute_fraction
    return Speed(
        len(chunk),
        len(tokens),
        cpu["full"],
        wall["full"],
        cpu["prefill"],
        wall["prefill"],
        wall["e2e"],
        fraction,
    )


def make_client(engine: HFEngine, config: ClientConfig) -> CacheClient:
    """A client for ``engine``'s model (nope K, position-independent blocks)."""
    return CacheClient(
        config,
        fingerprint=engine.fingerprint(StoredForm.NOPE),
        rope=engine.rope,
        v_head_dim=engine.stack.head_dim,
    )


def evaluate(
    engine: HFEngine,
    tokenizer: PreTrainedTokenizerBase,
    client: CacheClient,
    prompts: Sequence[EvalPrompt],
    configs: Sequence[Config],
    stop: Sequence[int],
    progress: Callable[[str], None],
) -> tuple[list[Case], list[Row]]:
    """Build every case of ``prompts`` and measure every configuration on them."""
    cases = []
    wanted = tuple(dict.fromkeys(c.sink for c in configs))
    for p in prompts:
        cases.append(build_case(engine, tokenizer, client, p, stop, wanted))
        c = cases[-1]
        progress(
            f"{p.half:6s} {p.name:22s} {len(c.tokens):4d} tokens, chunks "
            f"{[len(x) for x in c.parts.chunks]}, answer {c.ref.text!r}; {c.fact_note}"
        )
    rows = []
    for cfg in configs:
        row = Row(cfg)
        for case in cases:
            measure(engine, tokenizer, case, row, stop)
        rows.append(row)
        progress(f"{cfg.label:34s} recompute {row.fraction:.3f} KL {row.mean_kl:.4f}")
    return cases, rows


def main(argv: Sequence[str] | None = None) -> None:
    """Run the benchmark and print the tables and the RESULT line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--half", choices=("report", "tune", "both"), default="report")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds for the speed-up")
    parser.add_argument("--prompts", type=int, default=0, help="first N prompts of a half")
    parser.add_argument("--no-speed", action="store_true", help="skip the speed case")
    parser.add_argument(
        "--configs",
        default="",
        help="only configurations whose label contains this (or one of several, split by |)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: 1 prompt, only the configurations the RESULT line names, one "
        "round on a 200-token document",
    )
    args = parser.parse_args(argv)
    quick_configs = args.quick and not args.configs
    if args.quick:
        args.prompts, args.repeat = args.prompts or 1, 1
    # A SIGTERM unwinds like an exception, so the server child is killed on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    began = time.perf_counter()

    def progress(line: str) -> None:
        print(f"[{time.perf_counter() - began:6.1f}s] {line}", flush=True)

    tokenizer = load_tokenizer(progress=progress)
    engine = HFEngine(load_model(progress=progress), name="SmolLM2-135M-Instruct")
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]
    halves = ("tune", "report") if args.half == "both" else (args.half,)
    results: dict[str, tuple[list[Case], list[Row]]] = {}
    with (
        tempfile.TemporaryDirectory() as tmp,
        cache_server("2GiB", Path(tmp) / "server.log") as address,
    ):
        progress(f"cache server on {address}")
        config = ClientConfig(
            servers=(address,),
            prefix_block_tokens=PREFIX_BLOCK,
            # Plans must not depend on timings, nor on a deadline missed on a busy machine.
            cost=CostConfig(enabled=False),
            lookup_timeout_s=30.0,
            get_timeout_s=60.0,
            put_timeout_s=60.0,
        )
        with make_client(engine, config) as client:
            for name in halves:
                prompts = half(name)
                prompts = prompts[: args.prompts] if args.prompts else prompts
                named = (BASELINE, FIRST_K, DEVIATION, DEFAULT)  # the RESULT line needs them
                configs = [
                    c
                    for c in CONFIGS
                    if c in named
                    or (
                        any(part in c.label for part in args.configs.split("|"))
                        and not quick_configs
                    )
                ]
                results[name] = evaluate(
                    engine, tokenizer, client, prompts, configs, stop, progress
                )
            last_cases, _ = results[halves[-1]]
            exact = max(exact_prefix_kl(engine, client, c) for c in last_cases[:6])
        progress(f"exact prefix reuse: max mean KL {exact:.2e}")
        chunk_tokens = QUICK_SPEED_CHUNK_TOKENS if args.quick else SPEED_CHUNK_TOKENS
        timing = (
            None if args.no_speed else speed(engine, tokenizer, address, args.repeat, chunk_tokens)
        )

    for name, (cases, rows) in results.items():
        base = next(r for r in rows if r.config == BASELINE)
        print()
        print(
            f"{name} half: {len(cases)} prompts, {sum(len(c.ref.answer) for c in cases)} "
            f"answer tokens, facts counted (full answer holds them by >= {FACT_MARGIN:g} nats): "
            f"{sum(c.has_fact for c in cases)}/{len(cases)}"
        )
        print_table(rows, base)
        print("facts per prompt (counted only by a clear margin in the full answer):")
        for c in cases:
            print(f"  {c.prompt.name:22s} {c.fact_note}: {c.ref.text!r}")
    if timing is not None:
        print(
            f"\nspeed: {timing.chunk_tokens}-token chunk in a {timing.prompt_tokens}-token "
            f"prompt, {DEFAULT.label} (recompute {timing.fraction:.3f}): full "
            f"{timing.full_cpu:.3f}s CPU / {timing.full_wall:.3f}s wall; prefill "
            f"{timing.prefill_cpu:.3f}s CPU / {timing.prefill_wall:.3f}s wall; lookup + "
            f"fetch + prefill {timing.e2e_wall:.3f}s wall"
        )
    print(f"wall time {time.perf_counter() - began:.0f}s, {args.threads} thread(s)")

    cases, rows = results[halves[-1]]
    by = {r.config.label: r for r in rows}
    base, dev, fk, default = (by[c.label] for c in (BASELINE, DEVIATION, FIRST_K, DEFAULT))
    gap = {label: 1.0 - r.mean_kl / base.mean_kl for label, r in by.items()}
    within = [r for r in rows if r.fraction <= MAX_SHARE]
    best = max(within, key=lambda r: gap[r.config.label])
    budget_error = max(r.max_error_pp for r in rows if r.config.policy.budget > 0)
    speedup = timing.full_cpu / timing.prefill_cpu if timing else float("nan")
    e2e = timing.full_wall / timing.e2e_wall if timing else float("nan")
    print(f"best at <= {MAX_SHARE:.0%} recompute: {best.config.label}")
    print(
        f"RESULT exact_kl={exact:.2e} none_top1={base.mean_top1:.4f} none_kl={base.mean_kl:.4f} "
        f"firstk_top1={fk.mean_top1:.4f} deviation_top1={dev.mean_top1:.4f} "
        f"deviation_kl={dev.mean_kl:.4f} deviation_recompute={dev.fraction:.4f} "
        f"deviation_gap_recovered={gap[dev.config.label]:.4f} "
        f"best_gap_recovered_at_25={gap[best.config.label]:.4f} "
        f"fact_kept={default.fact_kept:.4f} speedup={speedup:.3f} "
        f"report_gap_at_budget={gap[default.config.label]:.4f} "
        f"report_fact_kept={default.fact_kept:.4f} budget_error_pp={budget_error:.3f} "
        f"e2e_speedup={e2e:.3f}"
    )


if __name__ == "__main__":
    main()
