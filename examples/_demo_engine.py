"""The engine processes of ``examples/demo.py``: SmolLM2 on the CPU with nopecache reuse.

Each engine is its own process (``multiprocessing`` spawn) holding its own model and its
own :class:`~nopecache.client.CacheClient`; the two share KV only through the server::

    engine 1   [system prompt][question 1][assistant]        prefill, store, answer
                ^ position 0
    engine 2   [uploaded report ~500 tok][system prompt][question 2][assistant]
                                         ^ lands at ~500: prefix caching misses, nopecache
                                           fetches it re-rotated and recomputes a few tokens

Segments are chat messages: each message is tokenized on its own, so the system prompt
has the same token ids in both prompts and its chunks the same content keys.
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
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from nopecache.client import CacheClient, ClientConfig
from nopecache.client.adapters import recompute as rc
from nopecache.client.adapters.hf import CacheClientSource, HFEngine, ReusedKV
from nopecache.client.adapters.hf_forward import PrefillOutput
from nopecache.client.adapters.local_model import load_model, load_tokenizer
from nopecache.client.chunking import ContentChunker
from nopecache.proto.block import StoredForm

MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
NAMESPACE = "nopecache-demo"
# Chunks up to a few hundred tokens: a system prompt becomes one or two chunks, so the
# policy's "first tokens of each chunk" stay few (content chunks still survive a move).
CHUNKER = ContentChunker(min_size=64, avg_size=256, max_size=512)

SYSTEM_PROMPT = (
    "You are Pip, the customer support assistant of Larkspur Rail, a regional train "
    "company. Always introduce yourself as Pip. Be brief and friendly.\n\n"
    "Facts you must use:\n"
    "- Refund policy number: RP-7342. Tickets are refunded in full up to 48 hours before "
    "departure.\n"
    "- Lost luggage: report it within 14 days using form LL-19 at any station desk.\n"
    "- Pets: small pets ride free in a carrier; dogs over 10 kg need a pet ticket for 6 euros.\n"
    "- Bikes: folding bikes ride free; other bikes need a reservation on routes R2 and R5.\n"
    "- Customer line: +44 20 7946 0815, open 7:00 to 22:00 every day.\n"
    "- Delay compensation: 25% of the fare for 30 minutes late, 50% for 60 minutes, 100% for "
    "120 minutes.\n"
    "- The first-class lounge at Larkspur Central opens at 5:30 and closes at 23:00.\n"
    "- Wi-Fi network name on board: LarkspurGuest, no password.\n"
    "Never invent a policy number: if asked, quote RP-7342 exactly."
)
QUESTION_1 = "What is your name?"
QUESTION_2 = "Which form do I use to report my lost suitcase, and within how many days?"

REPORT_PARAGRAPHS = (
    "Trip report, submitted by Dana Whitfield, passenger on train R2 from Larkspur Central "
    "to Millbrook Harbour, Tuesday 4 March.",
    "Summary. The 08:12 departure left Larkspur Central at 08:31, nineteen minutes late, "
    "because of a signal fault near Ashford Junction. The driver announced the delay twice, "
    "and the announcements were clear. Between Ashford Junction and Fenwick the train "
    "stopped three more times for a few minutes each, and we finally reached Millbrook "
    "Harbour at 10:07 instead of the scheduled 09:04, so sixty-three minutes late in total.",
    "Luggage. I travelled with a large blue suitcase and a folding bike. The suitcase was "
    "placed on the rack at the end of coach C. When we arrived at Millbrook Harbour the "
    "suitcase was not there. I checked the other racks and asked the guard, who suggested "
    "it might have been taken off by mistake at Fenwick, where many passengers changed "
    "trains. The suitcase has a yellow ribbon on the handle and a name tag with my phone "
    "number. It contains clothes, a laptop charger and two books.",
    "Onboard conditions. Coach C was crowded because coach D was closed for cleaning. "
    "Several passengers stood in the vestibule with suitcases. The heating in coach C "
    "worked, but the toilet at the rear was out of order for the whole journey. The onboard "
    "Wi-Fi connected but dropped every few minutes, which made it hard to work. The trolley "
    "service reached coach C only once, at about 09:20, and had run out of sandwiches by "
    "then. Staff were polite and apologised for the delay.",
    "Connections. Because of the delay I missed the 09:15 ferry from Millbrook Harbour to "
    "Saltmarsh Island and had to wait for the 11:00 ferry. The ferry company did not accept "
    "my rail ticket as proof of the delay. I spent 14 euros on lunch while waiting. I would "
    "also like to know if the missed meeting on the island can be taken into account, "
    "although I understand this may not be covered.",
    "Return journey. On the way back on Thursday 6 March the 17:40 from Millbrook Harbour "
    "was on time and comfortable. The Wi-Fi worked well, coach B was quiet, and the guard "
    "helped an elderly passenger with her luggage. I want to thank the staff on that train.",
    "Requests. I would like to know how much compensation I can claim for the sixty-three "
    "minute delay on my ticket, which cost 38 euros, how to report my missing suitcase, and "
    "whether the folding bike needed a reservation, because a member of staff at Larkspur "
    "Central told me it did. Please reply by email or call me on the number on my luggage "
    "tag.",
)
QUICK_REPORT_PARAGRAPHS = 3
"""``--quick`` uploads only the report's first paragraphs (~170 tokens instead of ~600)."""


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


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A prompt made of chat messages, tokenized one message at a time."""

    tokens: tuple[int, ...]
    segments: tuple[int, ...]  # where each message starts
    names: tuple[str, ...]

    def sizes(self) -> tuple[tuple[str, int], ...]:
        """(message name, tokens) in prompt order."""
        ends = (*self.segments[1:], len(self.tokens))
        return tuple((n, e - s) for n, s, e in zip(self.names, self.segments, ends, strict=True))


def chat_prompt(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[tuple[str, str, str]]
) -> ChatPrompt:
    """``(name, role, content)`` messages in SmolLM2's ChatML, then the assistant header.

    The chat template would insert a default system prompt when the first message is not
    one; building the ChatML here keeps every message's token ids independent of its place.
    """
    tokens: list[int] = []
    segments: list[int] = []
    names: list[str] = []
    parts = [(n, f"<|im_start|>{r}\n{c}<|im_end|>\n") for n, r, c in messages]
    for name, text in [*parts, ("assistant header", "<|im_start|>assistant\n")]:
        segments.append(len(tokens))
        names.append(name)
        tokens += tokenizer.encode(text, add_special_tokens=False)
    return ChatPrompt(tuple(tokens), tuple(segments), tuple(names))


def engine_prompt(tokenizer: PreTrainedTokenizerBase, job: EngineJob) -> ChatPrompt:
    """Engine 1's chat (system prompt first) or engine 2's (uploaded report first)."""
    system = ("system prompt", "system", SYSTEM_PROMPT)
    if job.role == 1:
        return chat_prompt(tokenizer, [system, ("question", "user", QUESTION_1)])
    paragraphs = REPORT_PARAGRAPHS[:QUICK_REPORT_PARAGRAPHS] if job.quick else REPORT_PARAGRAPHS
    report = "Here is the trip report I uploaded:\n\n" + "\n\n".join(paragraphs)
    return chat_prompt(
        tokenizer,
        [("uploaded report", "user", report), system, ("question", "user", QUESTION_2)],
    )


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
    process group) and stops an engine with SIGTERM, which unwinds it like Ctrl-C would:
    one signal, so the cache client's close is not itself interrupted.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        report = _run(job)
    except KeyboardInterrupt:
        return
    results.send(report)
    results.close()


def _interrupt(signum: int, frame: FrameType | None) -> NoReturn:
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
