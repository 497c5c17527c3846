"""The engine processes of ``examples/demo.py``: SmolLM2 on the CPU with nopecache reuse.

Each engine is its own process (``multiprocessing`` spawn) holding its own model and its
own :class:`~nopecache.client.CacheClient`; the two share KV only through the server::

    engine 1   [system prompt][question 1][assistant]        prefill, store, answer
                ^ position 0
    engine 2   [uploaded report ~500 tok][system prompt][question 2][assistant]
                                         ^ lands at ~500: prefix caching misses, nopecache
                                           fetches it re-rotated and recomputes a few tokens

The prompts are the demos' shared scenario (``_demo_scenario.py``).
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import FrameType
from typing import NoReturn

import torch
from _demo_scenario import ChatPrompt, scenario_prompt
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from nopecache.client import CacheClient, ClientConfig
from nopecache.client.chunking import ContentChunker
from nopecache.integrations.hf.adapter import CacheClientSource, HFEngine, ReusedKV
from nopecache.integrations.hf.forward import PrefillOutput
from nopecache.proto.block import StoredForm
from nopecache.recompute import policies as rc
from tests.support.local_model import load_model, load_tokenizer

MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
NAMESPACE = "nopecache-demo"
# Chunks up to a few hundred tokens: a system prompt becomes one or two chunks, so the
# policy's "first tokens of each chunk" stay few (content chunks still survive a move).
CHUNKER = ContentChunker(min_size=64, avg_size=256, max_size=512)


@dataclass(frozen=True, slots=True)
class EngineJob:
    """What one engine process does: which role, against which server, how much."""

    role: int  # 1: system prompt at position 0, stores; 2: report first, reuses
    server: str  # host:port of the nopecache server
    quick: bool = False
    max_new_tokens: int = 30
    timing_runs: int = 3

    def __post_init__(self) -> None:
        if self.role not in (1, 2):
            raise ValueError(f"role: must be 1 or 2, got {self.role!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if self.timing_runs < 1:
            raise ValueError(f"timing_runs: must be >= 1, got {self.timing_runs}")


@dataclass(frozen=True, slots=True)
class EngineReport:
    """What an engine process did, sent back to the demo's main process."""

    role: int
    pid: int
    prompt_tokens: int
    segment_tokens: tuple[tuple[str, int], ...]  # (message, tokens) in prompt order
    answer: str
    policy: str = ""
    stored_blocks: int = 0
    reused_exact: int = 0
    reused_pi: int = 0
    reused_chunks: int = 0
    recomputed_per_layer: tuple[int, ...] = ()  # reused tokens recomputed at each layer
    recompute_fraction: float = 0.0  # share of reused token-layers recomputed
    fetch_s: float = 0.0
    prefill_cached_s: float = 0.0
    prefill_nocache_s: float = 0.0
    nocache_answer: str = ""


def engine_prompt(tokenizer: PreTrainedTokenizerBase, job: EngineJob) -> ChatPrompt:
    """Engine 1's chat (system prompt first) or engine 2's (uploaded report first)."""
    return scenario_prompt(tokenizer, job.role, job.quick)


def _client(engine: HFEngine, server: str) -> CacheClient:
    # The cost model is on, as in production: the first lookup of a server keeps every
    # hit (nothing measured yet), and the adapter reports each prefill to it.
    config = ClientConfig(servers=(server,), namespace=NAMESPACE)
    return CacheClient(
        config,
        fingerprint=engine.fingerprint(StoredForm.NOPE),
        rope=engine.rope,
        v_head_dim=engine.stack.head_dim,
        chunker=CHUNKER,
    )


def _say(job: EngineJob, line: str) -> None:
    print(f"  [engine {job.role}] {line}", flush=True)


def _answer(
    engine: HFEngine, tokenizer: PreTrainedTokenizerBase, out: PrefillOutput, job: EngineJob
) -> str:
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert isinstance(stop, int)  # one token in, one id out
    tokens = engine.generate(out, job.max_new_tokens, [stop])
    return str(tokenizer.decode(tokens, skip_special_tokens=True)).strip()


def _median_times(fns: Sequence[Callable[[], object]], runs: int) -> list[float]:
    """Median wall time of each of ``fns``, run in turn ``runs`` times.

    Taking turns spreads load from other processes on the machine over all of them alike.
    """
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(runs):
        for fn, samples in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
    return [statistics.median(samples) for samples in times]


def run_engine_1(
    engine: HFEngine, tokenizer: PreTrainedTokenizerBase, client: CacheClient, job: EngineJob
) -> EngineReport:
    """Prefill the chat with the system prompt at position 0, store its KV, answer."""
    prompt = engine_prompt(tokenizer, job)
    _say(job, f"prompt: {_sizes(prompt)}")
    start = time.perf_counter()
    out = engine.prefill(prompt.tokens, capture=True)
    prefill_s = time.perf_counter() - start
    _say(job, f"prefill (empty cache, first call): {prefill_s * 1e3:.0f} ms")
    # Prefix blocks (exact reuse at the same positions) and content chunks per message
    # (reuse anywhere), both from this one prefill's pre-RoPE K and V.
    report = client.store(
        prompt.tokens,
        (engine.captured(out).k_nope, out.v),
        0,
        form="nope",
        segments=list(prompt.segments),
        wait=True,
    )
    _say(job, f"stored {report.stored} blocks ({report.nbytes / 2**20:.1f} MiB) on the server")
    answer = _answer(engine, tokenizer, out, job)
    return EngineReport(
        role=1,
        pid=os.getpid(),
        prompt_tokens=len(prompt.tokens),
        segment_tokens=prompt.sizes(),
        answer=answer,
        stored_blocks=report.stored,
        prefill_nocache_s=prefill_s,
    )


def run_engine_2(
    engine: HFEngine, tokenizer: PreTrainedTokenizerBase, client: CacheClient, job: EngineJob
) -> EngineReport:
    """Reuse the system prompt's KV after an uploaded report; compare with no cache."""
    prompt = engine_prompt(tokenizer, job)
    _say(job, f"prompt: {_sizes(prompt)}")
    policy = rc.DEFAULT_POLICY
    source = CacheClientSource(client, engine)  # reports every prefill to the cost model
    _say(job, "warm-up: one prefill without cache (first calls allocate and are slower)")
    nocache = engine.prefill(prompt.tokens)
    start = time.perf_counter()
    reused = source.reuse(prompt.tokens, prompt.segments)
    fetch_s = time.perf_counter() - start
    if reused is None:
        raise RuntimeError(
            "engine 2 found nothing in the cache: engine 1's blocks are gone or the server is down"
        )
    layout = reused.layout
    _say(
        job,
        f"lookup + fetch: {layout.prefix_end} exact-prefix and {layout.num_pi} "
        f"position-independent tokens ({len(layout.chunks)} chunks, re-rotated to "
        f"positions {_spans(reused)}) in {fetch_s * 1e3:.0f} ms",
    )
    cached = engine.prefill(prompt.tokens, reused, policy)
    cached_s, nocache_s = _median_times(
        [
            lambda: engine.prefill(prompt.tokens, reused, policy),
            lambda: engine.prefill(prompt.tokens),
        ],
        job.timing_runs,
    )
    _say(
        job,
        f"prefill with cache (policy {policy.name}): {cached_s * 1e3:.0f} ms, "
        f"without: {nocache_s * 1e3:.0f} ms (median of {job.timing_runs})",
    )
    return EngineReport(
        role=2,
        pid=os.getpid(),
        prompt_tokens=len(prompt.tokens),
        segment_tokens=prompt.sizes(),
        answer=_answer(engine, tokenizer, cached, job),
        policy=policy.name,
        reused_exact=layout.prefix_end,
        reused_pi=layout.num_pi,
        reused_chunks=len(layout.chunks),
        recomputed_per_layer=tuple(int(n) for n in cached.recomputed),
        recompute_fraction=cached.recompute_fraction,
        fetch_s=fetch_s,
        prefill_cached_s=cached_s,
        prefill_nocache_s=nocache_s,
        nocache_answer=_answer(engine, tokenizer, nocache, job),
    )


def _sizes(prompt: ChatPrompt) -> str:
    parts = " + ".join(f"{n} {t}" for n, t in prompt.sizes())
    return f"{len(prompt.tokens)} tokens = {parts}"


def _spans(reused: ReusedKV) -> str:
    return ", ".join(f"{s.start}-{s.end - 1}" for s in reused.layout.chunks)


def engine_main(job: EngineJob, results: Connection) -> None:
    """Process entry: load SmolLM2, run the job's role, send an :class:`EngineReport`.

    The demo's main process alone handles Ctrl-C (a terminal sends SIGINT to the whole
    process group) and stops an engine by SIGTERM to the engine's own process group,
    made here first thing, so that anything the engine starts stops with it. SIGTERM
    unwinds the engine like Ctrl-C would, at the next Python step: between two torch ops
    of a forward, between two tensors of a model load, in a wait on the server. One
    signal, so the cache client's close is not itself interrupted; should the unwinding
    stall, the demo SIGKILLs the group after a grace (``tests/support/proc_groups.py``).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _interrupt)
    os.setpgid(0, 0)
    try:
        report = _run(job)
    except KeyboardInterrupt:
        return
    results.send(report)
    results.close()


def _interrupt(signum: int, frame: FrameType | None) -> NoReturn:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one unwinding; a second would cut it
    raise KeyboardInterrupt


def _run(job: EngineJob) -> EngineReport:
    torch.set_grad_enabled(False)
    _say(job, f"pid {os.getpid()}: loading SmolLM2-135M-Instruct on the CPU")
    start = time.perf_counter()
    tokenizer = load_tokenizer(progress=lambda line: _say(job, line))
    model = load_model(progress=lambda line: _say(job, line))
    engine = HFEngine(model, name=MODEL_NAME)
    _say(job, f"model ready in {time.perf_counter() - start:.1f} s")
    with _client(engine, job.server) as client:
        run = run_engine_1 if job.role == 1 else run_engine_2
        return run(engine, tokenizer, client, job)
