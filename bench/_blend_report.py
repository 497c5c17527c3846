"""bench/quality.py's report half as shapes for bench/vllm_blend.py (``--set report``).

Each prompt of ``_quality_set`` becomes a :class:`~_blend_shapes.Shape` whose messages are
each their own segment (the connector cuts at ``<|im_start|>``):

* target: the prompt's context as a conversation (system message, the context as a user
  message, ``Noted.``), then its chunks, each a message (raw-text chunks a user message,
  chat chunks in their roles), then the question as the last user message;
* stored (what engines answered earlier): the context conversation alone (an exact-prefix
  hit for the target), and the chunks as bench/quality.py cached them: each on its own
  behind a short system message, or together inside an earlier request after other text
  and in ``cached_order`` (``cached_after``).

The fact counts, as in bench/quality.py, only where the no-cache answer holds it by a clear
margin: every answer token spelling it is the reference's top token by ``FACT_MARGIN``
nats over its runner-up (read from the reference's top-``TOP`` prompt logprobs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from _blend_shapes import Expected, Message, Shape
from _quality_eval import FACT_MARGIN
from _quality_prompts import SYSTEM
from _quality_set import EvalPrompt, half
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

__all__ = ["FACT_MARGIN", "fact_margin", "report_shapes", "shape_of"]

HELPER = "You are a helpful assistant."
"""The system message a chunk cached on its own was answered behind."""


def _conversation(user: str) -> tuple[Message, ...]:
    return (("system", SYSTEM), ("user", user), ("assistant", "Noted."))


def shape_of(p: EvalPrompt) -> Shape:
    """The prompt as chat messages (see the module doc)."""
    chunks: tuple[Message, ...] = (
        tuple(zip(p.roles, p.chunks, strict=True))
        if p.chat
        else tuple(("user", text) for text in p.chunks)
    )
    context = _conversation(p.context)
    if p.cached_after:
        order = p.cached_order or tuple(range(len(chunks)))
        stored = (*_conversation(p.cached_after), *(chunks[i] for i in order))
        more: tuple[tuple[Message, ...], ...] = ()
    else:
        stored = (("system", HELPER), chunks[0])
        more = tuple((("system", HELPER), chunk) for chunk in chunks[1:])
    facts: Expected = p.facts if len(p.facts) > 1 else p.expected
    return Shape(
        p.name,
        stored=stored,
        target=(*context, *chunks),
        questions=((p.question, facts),),
        stored_more=(context, *more),
        kind=p.kind,
    )


def report_shapes() -> list[Shape]:
    """Every prompt of the report half."""
    return [shape_of(p) for p in half("report")]


def fact_margin(
    tokenizer: PreTrainedTokenizerBase,
    answer: Sequence[int],
    logprobs: Sequence[dict[str, float]],
    expected: Expected,
) -> float | None:
    """The smallest top-1 over top-2 log-probability gap of the answer tokens spelling
    ``expected`` (``logprobs[j]`` the reference's top tokens predicting ``answer[j]``);
    None where the answer lacks it."""
    wanted = (expected,) if isinstance(expected, str) else expected
    text = str(tokenizer.decode(list(answer)))
    if not all(w.lower() in text.lower() for w in wanted):
        return None
    ends = [len(tokenizer.decode(list(answer[: i + 1]))) for i in range(len(answer))]
    gaps = []
    for lps in logprobs:
        top = sorted(lps.values(), reverse=True)
        gaps.append(top[0] - top[1] if len(top) > 1 else math.inf)
    margin = math.inf
    for w in wanted:
        at = text.lower().find(w.lower())
        first = next(i for i, end in enumerate(ends) if end > at)
        last = next((i for i, end in enumerate(ends) if end >= at + len(w)), len(ends) - 1)
        margin = min(margin, min(gaps[first : last + 1]))
    return margin
