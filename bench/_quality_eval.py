"""Cases and measurements of bench/quality.py: prompts stored and reused through the client.

For each prompt of ``_quality_set``: the reference (full prefill, its greedy answer and
the next-token distributions along it, cached on disk by the prompt's tokens), then the
stores a user's engine would have made earlier, through the real ``CacheClient`` into a
real server: the context as an exact prefix, the chunks on their own (without and with
the sink prefix, one namespace each) or inside an earlier request after other text. Each
prompt gets namespaces of its own, so prompts sharing a document do not share its KV.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from _quality_prompts import SYSTEM
from _quality_set import EvalPrompt
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from nopecache.client.sync_client import CacheClient
from nopecache.integrations.hf.adapter import (
    NEWLINE_SINK,
    CacheClientSource,
    CapturedKV,
    HFEngine,
    ReusedKV,
)
from nopecache.integrations.hf.forward import PrefillOutput
from nopecache.recompute.policies import RecomputePolicy

MAX_ANSWER = 24
FACT_MARGIN = 1.0
"""Nats by which the full prefill's answer must prefer each token spelling the fact over
its runner-up for the prompt's fact to count: a fact the full prefill itself barely
chooses says nothing about what reuse keeps."""
CHAT_SINK = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
DIALOG_SINK = CHAT_SINK + (
    "<|im_start|>user\nHi, can you help me with something?<|im_end|>\n"
    "<|im_start|>assistant\nOf course. What do you need?<|im_end|>\n"
)
SINK_LABELS: dict[str, str] = {
    "": "",
    "newline": " +sink",
    "chat": " +chat sink",
    "dialog": " +dialog sink",
}
REF_CACHE = Path(__file__).resolve().parent / ".cache" / "quality"


Sink = Literal["", "newline", "chat", "dialog"]
SINKS: tuple[Sink, ...] = ("", "newline", "chat", "dialog")
"""How a chunk cached on its own was computed: from position 0 (``""``), behind one
newline token (``newline``), or behind what precedes such a chunk in a chat, chosen per
chunk by how it begins: ``chat`` a short system message, plus the user header when the
chunk is raw text; ``dialog`` the same with one generic exchange before it."""


@dataclass(frozen=True, slots=True)
class Config:
    """A recompute policy and the sink chunks cached on their own were computed behind."""

    policy: RecomputePolicy
    sink: Sink = ""

    @property
    def label(self) -> str:
        """Row label of the tables."""
        return self.policy.name + SINK_LABELS[self.sink]


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of ``text`` (no special tokens added)."""
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def decode(tokenizer: PreTrainedTokenizerBase, tokens: list[int]) -> str:
    """Text of ``tokens``."""
    text = tokenizer.decode(tokens)
    assert isinstance(text, str)
    return text


def conversation(user: str) -> str:
    """System message, one user message and a short assistant reply (chat template)."""
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
        f"<|im_start|>user\n{user}<|im_end|>\n"
        "<|im_start|>assistant\nNoted.<|im_end|>\n"
    )


@dataclass(frozen=True, slots=True)
class Parts:
    """A prompt's token segments, each tokenized on its own (so a chunk's tokens are the
    same wherever it lands)."""

    context: list[int]
    opener: list[int]
    chunks: list[list[int]]
    question: list[int]

    @property
    def tokens(self) -> list[int]:
        """The whole prompt."""
        return [*self.context, *self.opener, *(t for c in self.chunks for t in c), *self.question]

    @property
    def chunk_starts(self) -> list[int]:
        """Where each chunk starts in the prompt."""
        starts, at = [], len(self.context) + len(self.opener)
        for chunk in self.chunks:
            starts.append(at)
            at += len(chunk)
        return starts

    @property
    def segments(self) -> list[int]:
        """Segment starts: opener, each chunk, the question."""
        cuts = [len(self.context), *self.chunk_starts, len(self.tokens) - len(self.question)]
        return sorted(set(cuts))


def parts(tokenizer: PreTrainedTokenizerBase, p: EvalPrompt) -> Parts:
    """The token segments of ``p``: chat messages, or raw text inside one user message."""
    context = encode(tokenizer, conversation(p.context))
    if p.chat:
        chunks = [
            encode(tokenizer, f"<|im_start|>{role}\n{text}<|im_end|>\n")
            for role, text in zip(p.roles, p.chunks, strict=True)
        ]
        question = f"<|im_start|>user\n{p.question}<|im_end|>\n<|im_start|>assistant\n"
        return Parts(context, [], chunks, encode(tokenizer, question))
    chunks = [encode(tokenizer, text + "\n\n") for text in p.chunks]
    question = f"Question: {p.question}<|im_end|>\n<|im_start|>assistant\n"
    return Parts(
        context, encode(tokenizer, "<|im_start|>user\n"), chunks, encode(tokenizer, question)
    )


@dataclass(frozen=True, slots=True)
class Reference:
    """The full prefill's greedy answer and its log-probabilities along it."""

    answer: list[int]
    logprobs: torch.Tensor  # [answer tokens, vocab]
    text: str


def answer_logprobs(engine: HFEngine, prefill: PrefillOutput, answer: list[int]) -> torch.Tensor:
    """Log-probabilities ``[len(answer), vocab]`` predicting each answer token, teacher-forced."""
    return engine.continuation_logits(prefill, answer[:-1]).log_softmax(-1)


def reference(
    engine: HFEngine, tokenizer: PreTrainedTokenizerBase, tokens: list[int], stop: Sequence[int]
) -> Reference:
    """The full prefill's answer, from the disk cache when this prompt was run before."""
    digest = hashlib.sha256(f"{engine.name}|{MAX_ANSWER}|{tokens}".encode()).hexdigest()[:24]
    path = REF_CACHE / f"{digest}.pt"
    if path.exists():
        saved = torch.load(path)
        return Reference(saved["answer"], saved["logprobs"], saved["text"])
    full = engine.prefill(tokens)
    answer = engine.generate(full, MAX_ANSWER, stop)
    ref = Reference(answer, answer_logprobs(engine, full, answer), decode(tokenizer, answer))
    REF_CACHE.mkdir(parents=True, exist_ok=True)
    torch.save({"answer": ref.answer, "logprobs": ref.logprobs, "text": ref.text}, path)
    return ref


def fact_margin(tokenizer: PreTrainedTokenizerBase, p: EvalPrompt, ref: Reference) -> float | None:
    """The smallest top-1 over top-2 log-probability gap of the full answer's tokens that
    spell the fact's strings (None: the answer does not hold them all)."""
    if not p.holds(ref.text):
        return None
    ends = [len(decode(tokenizer, ref.answer[: i + 1])) for i in range(len(ref.answer))]
    top2 = ref.logprobs.topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1]).tolist()
    text = ref.text.lower()
    margin = math.inf
    for fact in p.facts:
        at = text.find(fact.lower())
        first = next(i for i, end in enumerate(ends) if end > at)
        last = next((i for i, end in enumerate(ends) if end >= at + len(fact)), len(ends) - 1)
        margin = min(margin, min(gaps[first : last + 1]))
    return margin


@dataclass(slots=True)
class Case:
    """One prompt, its reference, and its reuse fetched through the client (per store form)."""

    prompt: EvalPrompt
    parts: Parts
    ref: Reference
    margin: float | None
    """``fact_margin`` of the full answer (None: it lacks the fact)."""
    reused: dict[Sink, ReusedKV] = field(default_factory=dict)

    @property
    def tokens(self) -> list[int]:
        """The whole prompt."""
        return self.parts.tokens

    @property
    def has_fact(self) -> bool:
        """Whether the prompt's fact counts: the full answer holds it by ``FACT_MARGIN``."""
        return self.margin is not None and self.margin >= FACT_MARGIN

    @property
    def fact_note(self) -> str:
        """Whether the fact counts, and why (for the per-prompt lines)."""
        if self.margin is None:
            return "fact not in the full answer"
        verdict = "counted" if self.has_fact else f"not counted (< {FACT_MARGIN:g})"
        return f"fact margin {self.margin:.2f} nats, {verdict}"


def _captured(engine: HFEngine, tokens: list[int]) -> CapturedKV:
    return engine.captured(engine.prefill(tokens, capture=True))


def build_case(
    engine: HFEngine,
    tokenizer: PreTrainedTokenizerBase,
    client: CacheClient,
    p: EvalPrompt,
    stop: Sequence[int],
    wanted: Sequence[Sink] = SINKS,
) -> Case:
    """Reference, stores and reuse of one prompt (see the module doc), for the ``wanted``
    sinks only (each costs a forward of every chunk and a store)."""
    pt = parts(tokenizer, p)
    ref = reference(engine, tokenizer, pt.tokens, stop)
    case = Case(p, pt, ref, fact_margin(tokenizer, p, ref))
    context_kv = _captured(engine, pt.context)
    earlier: tuple[list[int], CapturedKV, list[int]] | None = None
    if p.cached_after:
        # The request the chunks were first seen in: other text, then the chunks.
        head = encode(tokenizer, conversation(p.cached_after)) + pt.opener
        order = p.cached_order or tuple(range(len(pt.chunks)))
        tokens, cuts = list(head), [len(head)]
        for i in order:
            tokens += pt.chunks[i]
            cuts.append(len(tokens))
        earlier = (tokens, _captured(engine, tokens), cuts[:-1])
    sinks: dict[Sink, list[int]] = {
        "": [],
        "newline": list(NEWLINE_SINK),
        "chat": encode(tokenizer, CHAT_SINK) + pt.opener,
        "dialog": encode(tokenizer, DIALOG_SINK) + pt.opener,
    }
    for sink, sink_tokens in sinks.items():
        if sink not in wanted:
            continue
        source = CacheClientSource(client, wait=True, namespace=f"{p.name}/sink={sink}")
        source.store(pt.context, context_kv, position_independent=False)
        if earlier is not None:
            tokens, kv, cuts = earlier
            source.store(tokens, kv, cuts, prefix=False)
        else:
            for chunk in pt.chunks:
                kv = engine.chunk_kv(chunk, sink_prefix=sink_tokens)
                source.store(chunk, kv, prefix=False)
        reused = source.reuse(pt.tokens, pt.segments)
        want = sum(len(c) for c in pt.chunks)
        if reused is None or reused.layout.num_pi != want:
            got = 0 if reused is None else reused.layout.num_pi
            raise RuntimeError(f"{p.name} (sink {sink!r}): {got} of {want} chunk tokens reused")
        case.reused[sink] = reused
    return case


def exact_prefix_kl(engine: HFEngine, client: CacheClient, case: Case) -> float:
    """Mean answer KL when context and chunks come back as an exact prefix (lossless)."""
    pt = case.parts
    cut = len(pt.tokens) - len(pt.question)
    kv = _captured(engine, pt.tokens[:cut])
    source = CacheClientSource(client, wait=True, namespace=f"{case.prompt.name}/exact")
    source.store(pt.tokens[:cut], kv, position_independent=False)
    reused = source.reuse(pt.tokens, pt.segments)
    assert reused is not None and reused.layout.prefix_end > 0
    logprobs = answer_logprobs(engine, engine.prefill(pt.tokens, reused), case.ref.answer)
    ref = case.ref.logprobs
    return float((ref.exp() * (ref - logprobs)).sum(-1).mean())


@dataclass(slots=True)
class Row:
    """Pooled measurements of one configuration over a set of cases."""

    config: Config
    kl: list[torch.Tensor] = field(default_factory=list)
    top1: list[torch.Tensor] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    fractions: list[float] = field(default_factory=list)
    errors_pp: list[float] = field(default_factory=list)
    facts: list[bool] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    """Prompts whose fact the full answer has and this configuration's answer lacks."""

    @property
    def mean_kl(self) -> float:
        """Mean KL over every answer token of every prompt."""
        return float(torch.cat(self.kl).mean())

    def kind_kl(self, kind: str) -> float:
        """Mean KL over the answer tokens of one kind's prompts."""
        return float(
            torch.cat([k for k, n in zip(self.kl, self.kinds, strict=True) if n == kind]).mean()
        )

    @property
    def mean_top1(self) -> float:
        """Top-1 agreement over every answer token of every prompt."""
        return float(torch.cat(self.top1).float().mean())

    @property
    def fraction(self) -> float:
        """Mean realised share of the reused token-layers recomputed."""
        return sum(self.fractions) / len(self.fractions)

    @property
    def max_error_pp(self) -> float:
        """Largest |realised - configured| share of any prefill, in points."""
        return max(abs(e) for e in self.errors_pp)

    @property
    def fact_kept(self) -> float:
        """Share of the prompts with the fact in the full answer that keep it."""
        return sum(self.facts) / len(self.facts) if self.facts else 1.0


def measure(
    engine: HFEngine,
    tokenizer: PreTrainedTokenizerBase,
    case: Case,
    row: Row,
    stop: Sequence[int],
) -> None:
    """Add one case's measurements under ``row.config`` to ``row``.

    Where the policy agrees with the full prefill's argmax at every answer step its greedy
    answer is the same token for token, so only the other prompts are generated.
    """
    cfg = row.config
    out = engine.prefill(case.tokens, case.reused[cfg.sink], cfg.policy)
    logprobs = answer_logprobs(engine, out, case.ref.answer)
    ref = case.ref.logprobs
    row.kl.append((ref.exp() * (ref - logprobs)).sum(-1))
    agree = logprobs.argmax(-1) == ref.argmax(-1)
    row.top1.append(agree)
    row.kinds.append(case.prompt.kind)
    row.fractions.append(out.recompute_fraction)
    row.errors_pp.append(out.budget_error_pp)
    if case.has_fact:
        if bool(agree.all()):
            row.facts.append(True)
        else:
            text = decode(tokenizer, engine.generate(out, MAX_ANSWER, stop))
            row.facts.append(case.prompt.holds(text))
            if not row.facts[-1]:
                row.lost.append(f"{case.prompt.name}: {text!r}")
