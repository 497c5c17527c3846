"""The agent traffic bench/vllm_serve.py replays: sessions of chat requests, some with facts.

A :class:`Session` is requests sent one after another (the next turn of a chat waits for
the previous answer); several sessions are in flight at once. The sessions, in the order
the replay takes them::

    ferry_chat       a chat that grows turn by turn, then keeps only its newest 5 turns:
                     every truncation shifts the whole history left (facts: departure times)
    corpus_chat      a chat under a token budget from bench/_traces.py (prose, code, tool
                     output), its oldest turns dropped (no facts)
    agent_<name>     agents sharing one instruction block behind preambles of different
                     lengths, two requests each (facts: the handbook's times and names)
    rag_<n>          three retrieved documents in a new order each time (facts: the docs')
    tool_first       an agent calls a tool; its long JSON result is in the prompt
    tool_again       later, another agent's chat has the same tool result pasted again

Texts come from bench/_blend_shapes.py (the blend bench's facts, which SmolLM2 answers
without a cache) and bench/_traces.py's seeded corpus, so a seed gives the same trace in
every process. ``fact`` is a string the answer must contain to carry the fact, or None.

:func:`content_bound` is what any cache could serve at most: the tokens of each request
that appeared in an earlier request of the trace at any position (whole messages seen
before, and every token inside a 16-token run seen before), in trace order.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from _blend_shapes import (
    _DOCS,
    _FERRY_SYSTEM,
    _PREAMBLE_A,
    _PREAMBLE_B,
    _RAG_SYSTEM,
    _ROUTES,
    _SHARED_BLOCK,
    Message,
    _ferry_turns,
)
from _traces import Corpus, Segment, truncated_history

__all__ = ["RUN", "Prompt", "Session", "TraceRequest", "build_trace", "content_bound"]

RUN = 16  # a run of this many tokens seen before counts as content seen before


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request: chat messages (the generation prompt follows), answer length, fact."""

    kind: str
    messages: tuple[Message, ...]
    max_tokens: int
    fact: str | None = None


@dataclass(frozen=True, slots=True)
class Session:
    """Requests sent one after another."""

    name: str
    requests: tuple[TraceRequest, ...]


@dataclass(frozen=True, slots=True)
class Prompt:
    """A tokenized request: token ids and where each message starts."""

    tokens: tuple[int, ...]
    segments: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Size:
    """How much trace: chat turns and window, agents, RAG users, answer lengths."""

    ferry_turns: int = 10
    window: int = 5
    corpus_turns: int = 10
    corpus_budget: int = 1200
    agents: int = 4
    rag_users: int = 4
    fact_tokens: int = 24
    other_tokens: int = 8


QUICK = Size(
    ferry_turns=3,
    window=2,
    corpus_turns=0,
    agents=2,
    rag_users=2,
    fact_tokens=4,
    other_tokens=4,
)

_PREAMBLES = (
    ("atlas", _PREAMBLE_A),
    ("juniper", _PREAMBLE_B),
    (
        "basil",
        "You are Basil, the test agent of Orchard Labs. You run the test suites before every "
        "release and report each failure to the author of the change, with the failing test "
        "and the first lines of its output.",
    ),
    (
        "quill",
        "You are Quill, the documentation agent of Orchard Labs. You keep the team's guides "
        "up to date, answer questions about how the team works, and point people to the "
        "handbook section that covers their question. Quote times, places and names exactly "
        "as the handbook gives them; if the handbook is silent, say so and ask the planning "
        "agent. You write in short, plain sentences and never invent a rule.",
    ),
)
_HANDBOOK_QUESTIONS = (
    ("When does the deploy freeze start?", "15:00"),
    ("Who is the on-call engineer this month?", "Solberg"),
    ("When does the deploy freeze end?", "09:00"),
    ("Who is the on-call engineer this month?", "Solberg"),
)
_RAG_QUESTIONS = (
    ("Which port does the application server listen on?", "8443", 2),
    ("How many litres of water does the Zephyr X2 hold?", "1.7", 1),
    ("Which company services the backup generator of Building C?", "Halvorsen", 0),
    ("How many connections does the database pool hold?", "ten", 2),
)


def _ferry_chat(size: Size) -> Session:
    turns = _ferry_turns()[: size.ferry_turns]
    requests = []
    for k in range(1, len(turns) + 1):
        kept = turns[max(0, k - size.window) : k]
        messages: list[Message] = [("system", _FERRY_SYSTEM)]
        for user, assistant in kept:
            messages += [("user", user), ("assistant", assistant)]
        name, _, time, _, _ = _ROUTES[k - 1]
        question = f"At what time does the first ferry to {name} leave?"
        requests.append(
            TraceRequest("chat", (*messages, ("user", question)), size.fact_tokens, time)
        )
    return Session("ferry_chat", tuple(requests))


def _corpus_chat(size: Size, seed: int, measure: Callable[[Segment], int]) -> Session | None:
    if not size.corpus_turns:
        return None
    reqs = truncated_history(
        Corpus(seed), measure, conversations=1, turns=size.corpus_turns, budget=size.corpus_budget
    )
    return Session(
        "corpus_chat",
        tuple(
            TraceRequest("chat", tuple((s.role, s.text) for s in r.segments), size.other_tokens)
            for r in reqs
        ),
    )


def _agents(size: Size) -> list[Session]:
    sessions = []
    for i, (name, preamble) in enumerate(_PREAMBLES[: size.agents]):
        head: tuple[Message, ...] = (("system", preamble), ("user", _SHARED_BLOCK))
        q1, fact1 = _HANDBOOK_QUESTIONS[i % len(_HANDBOOK_QUESTIONS)]
        q2, fact2 = _HANDBOOK_QUESTIONS[(i + 1) % len(_HANDBOOK_QUESTIONS)]
        first = TraceRequest("agents", (*head, ("user", q1)), size.fact_tokens, fact1)
        reply = ("assistant", "I checked the shared handbook; here is what it says.")
        second = TraceRequest(
            "agents", (*head, ("user", q1), reply, ("user", q2)), size.fact_tokens, fact2
        )
        sessions.append(Session(f"agent_{name}", (first, second)))
    return sessions


def _rag(size: Size, seed: int) -> list[Session]:
    corpus = Corpus(seed)
    extra = tuple(
        "Document: " + corpus.document(corpus.topic(), 3) for _ in range(3)
    )  # retrieved alongside, no facts asked
    docs = (*_DOCS, *extra)
    rng = random.Random(seed)
    sessions = []
    for u in range(size.rag_users):
        question, fact, needed = _RAG_QUESTIONS[u % len(_RAG_QUESTIONS)]
        others = rng.sample([d for j, d in enumerate(docs) if j != needed], 2)
        picked = [docs[needed], *others]
        rng.shuffle(picked)
        messages = (
            ("system", _RAG_SYSTEM),
            *(("user", d) for d in picked),
            ("user", question),
        )
        sessions.append(
            Session(f"rag_{u}", (TraceRequest("rag", messages, size.fact_tokens, fact),))
        )
    return sessions


def _tool_result(seed: int) -> str:
    corpus = Corpus(seed)
    rows = [
        {
            "order": 5521 + i,
            "carrier": "Nordfrakt" if i == 0 else corpus.rng.choice(["Skyline", "Polar"]),
            "tracking": "NF-88213-QX" if i == 0 else f"PX-{corpus.rng.randint(10000, 99999)}",
            "note": corpus.paragraph("operations", 1),
        }
        for i in range(6)
    ]
    return json.dumps({"tool": "shipments", "rows": rows}, indent=1)


def _tools(size: Size, seed: int) -> tuple[Session, Session]:
    result = ("tool", _tool_result(seed))
    call = ("assistant", json.dumps({"call": "shipments", "order": 5521}))
    first = TraceRequest(
        "tool",
        (
            ("system", "You are Dispatch, the logistics agent. Answer in one sentence."),
            ("user", "Where is the shipment for order 5521?"),
            call,
            result,
            ("user", "Which carrier has order 5521?"),
        ),
        size.fact_tokens,
        "Nordfrakt",
    )
    again = TraceRequest(
        "tool",
        (
            (
                "system",
                "You are Sol, the customer support agent. Be brief and quote tracking numbers "
                "exactly as the tools give them.",
            ),
            ("user", "A customer asks about their parcel. Here is what the tool returned:"),
            result,
            ("user", "What is the tracking number of order 5521?"),
        ),
        size.fact_tokens,
        "88213",
    )
    return Session("tool_first", (first,)), Session("tool_again", (again,))


def build_trace(size: Size, seed: int, measure: Callable[[Segment], int]) -> list[Session]:
    """The sessions in replay order (the two chats first: they stay in flight throughout,
    and the short sessions stream past them)."""
    chats = [_ferry_chat(size)]
    corpus = _corpus_chat(size, seed, measure)
    if corpus is not None:
        chats.append(corpus)
    agents, rags = _agents(size), _rag(size, seed + 1)
    tool_first, tool_again = _tools(size, seed + 2)
    short: list[Session] = []
    for i in range(max(len(agents), len(rags))):
        short += agents[i : i + 1] + rags[i : i + 1]
        if i == 0:
            short.append(tool_first)
    short.append(tool_again)
    return [*chats, *short]


def content_bound(prompts: Sequence[Prompt]) -> list[int]:
    """Per prompt, in trace order: the tokens that appeared in an earlier prompt at any
    position (a whole message seen before, or inside a 16-token run seen before)."""
    runs: set[tuple[int, ...]] = set()
    segments: set[tuple[int, ...]] = set()
    bound = []
    for p in prompts:
        n = len(p.tokens)
        covered = [False] * n
        ends = (*p.segments[1:], n)
        for a, b in zip(p.segments, ends, strict=True):
            if p.tokens[a:b] in segments:
                covered[a:b] = [True] * (b - a)
        for i in range(n - RUN + 1):
            if p.tokens[i : i + RUN] in runs:
                covered[i : i + RUN] = [True] * RUN
        bound.append(sum(covered))
        runs.update(p.tokens[i : i + RUN] for i in range(n - RUN + 1))
        segments.update(p.tokens[a:b] for a, b in zip(p.segments, ends, strict=True))
    return bound
