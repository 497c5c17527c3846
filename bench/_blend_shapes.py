"""The four reuse shapes of bench/vllm_blend.py: what one engine stored, what another asks.

Every shape is chat messages (each message its own segment, so a message keeps its
content keys wherever it lands). ``stored`` is the prompt an engine answered earlier (its
KV is in the cache); ``target`` is the prompt measured, whose reused part sits at another
position or behind other text, less its last user message: one of ``questions``, each with
a string the answer must contain to carry the fact, which is only in the reused part::

    shape               stored                                  target
    truncated_history   [system][turn 0..9][question]           [system][turn 4..9][question]
    report_first        [system prompt][question]               [report][system prompt][question]
    shared_block        [preamble A][shared block][task]        [preamble B][shared block][task]
    rag_reordered       [system][doc A][doc B][doc C][question]  [system][doc C][doc A][doc B][q]

The texts are distinct across shapes, so no shape hits another's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from _demo_scenario import LONG_SYSTEM_PROMPT, QUESTION_1, REPORT_PARAGRAPHS
from _quality_prompts import CONTEXT_CHAT, CONTEXT_EMAILS, CONTEXT_NOTES, CONTEXT_REPORT
from _quality_set import FILLER

Message = tuple[str, str]  # (role, content)
Expected = str | tuple[str, ...]
"""A string the answer must contain, or several it must contain all of."""


def holds(expected: Expected, text: str) -> bool:
    """Whether ``text`` contains ``expected`` (every string of it), case-insensitive."""
    wanted = (expected,) if isinstance(expected, str) else expected
    return all(w.lower() in text.lower() for w in wanted)


@dataclass(frozen=True, slots=True)
class Shape:
    """One reuse shape: the stored prompt, the measured prompt and the facts to keep."""

    name: str
    stored: tuple[Message, ...]
    target: tuple[Message, ...]  # without the question
    questions: tuple[tuple[str, Expected], ...]  # (question, expected string(s) in the answer)
    stored_more: tuple[tuple[Message, ...], ...] = ()
    """Further prompts an engine answered earlier (stored after ``stored``, in order)."""
    kind: str = ""
    """The kind of bench/quality.py's set a shape made from one of its prompts has."""

    def asking(self, question: str) -> tuple[Message, ...]:
        """The target prompt's messages with ``question`` as the last user message."""
        return (*self.target, ("user", question))


_ROUTES = (
    ("Skerry Island", 3, "06:20", 35, 9),
    ("Gull Point", 5, "07:05", 50, 11),
    ("Port Allan", 1, "07:40", 25, 7),
    ("Kelp Bay", 4, "08:15", 65, 14),
    ("Tern Rock", 2, "09:30", 40, 10),
    ("Mistle Harbour", 6, "10:10", 80, 16),
    ("Osprey Cove", 7, "11:45", 30, 8),
    ("Rannoch Quay", 8, "13:20", 55, 12),
    ("Heron Sound", 9, "14:50", 45, 10),
    ("Saltby", 10, "16:35", 70, 15),
)


def _ferry_turns() -> list[tuple[str, str]]:
    turns = []
    for name, pier, time, minutes, fare in _ROUTES:
        turns.append(
            (
                f"Tell me about the crossing to {name}.",
                f"The first ferry to {name} leaves from pier {pier} at {time}. The crossing "
                f"takes {minutes} minutes and a single ticket costs {fare} euros; a return "
                f"costs twice that, and children under twelve pay half. Bicycles go on the "
                f"lower deck for 2 euros. The cafe on board sells coffee and sandwiches, and "
                f"the outside deck is closed when the wind is above force six. Boarding "
                f"closes ten minutes before departure, and the ticket office at pier {pier} "
                f"opens half an hour before the first sailing of the day.",
            )
        )
    return turns


_FERRY_SYSTEM = (
    "You are Wren, the travel assistant of Brightwater Ferries. Answer in one short "
    "sentence, using only the timetable details given in this conversation. " + CONTEXT_CHAT
)


def truncated_history() -> Shape:
    """A long chat whose four oldest turns were dropped: everything after the system moved."""
    turns = _ferry_turns()
    system = ("system", _FERRY_SYSTEM)

    def chat(kept: list[tuple[str, str]]) -> tuple[Message, ...]:
        messages: list[Message] = [system]
        for user, assistant in kept:
            messages += [("user", user), ("assistant", assistant)]
        return tuple(messages)

    return Shape(
        "truncated_history",
        stored=(*chat(turns), ("user", "Which crossing is the longest?")),
        target=chat(turns[4:]),
        questions=(("At what time does the first ferry to Saltby leave?", "16:35"),),
    )


def report_first() -> Shape:
    """The demo's scenario: an uploaded report lands before the system prompt."""
    report = "Here is the trip report I uploaded:\n\n" + "\n\n".join(REPORT_PARAGRAPHS)
    return Shape(
        "report_first",
        stored=(("system", LONG_SYSTEM_PROMPT), ("user", QUESTION_1)),
        target=(("user", report), ("system", LONG_SYSTEM_PROMPT)),
        questions=(("What is the refund policy number?", "RP-7342"), ("What is your name?", "Pip")),
    )


_SHARED_BLOCK = (
    "Shared operating handbook for every agent of the Orchard Labs team.\n\n"
    + "\n\n".join(FILLER)
    + "\n\nRelease rules. The deploy freeze starts every Friday at 15:00 and ends on Monday "
    "at 09:00. Release notes are posted in the channel #ship-it. The on-call engineer this "
    "month is Ingrid Solberg, and the incident phone line is 0161 555 0199. Every change "
    "needs one review from another team before it is merged."
)
_PREAMBLE_A = (
    "You are Atlas, the planning agent of Orchard Labs. You break a request into steps "
    "and hand each step to the right agent."
)
_PREAMBLE_B = (
    "You are Juniper, the release agent of Orchard Labs. You prepare releases, check that "
    "every change was reviewed, write the release notes and tell the team when a release "
    "is ready. You work with Atlas, the planning agent, and with Basil, the test agent, "
    "who runs the test suites before every release and reports failures to the author of "
    "the change. Keep your answers short and practical, name the people and the times "
    "exactly as the handbook gives them, and never guess a rule that is not written down. "
    "When a user asks about something outside releases, answer briefly and suggest which "
    "agent can help further."
)


def shared_block() -> Shape:
    """Two agents share one instruction block behind preambles of different lengths."""
    return Shape(
        "shared_block",
        stored=(
            ("system", _PREAMBLE_A),
            ("user", _SHARED_BLOCK),
            ("user", "Plan the steps for moving the team's meeting room bookings."),
        ),
        target=(("system", _PREAMBLE_B), ("user", _SHARED_BLOCK)),
        questions=(
            ("When does the deploy freeze start?", "15:00"),
            ("Who is the on-call engineer this month?", "Solberg"),
        ),
    )


_DOCS = (
    "Document: facilities handbook, power section. Halvorsen Electric is the company that "
    "services the backup generator of Building C, every March. The generator sits in the "
    "basement plant room and can run the lifts and the emergency lighting for eighteen "
    "hours.\n\n" + CONTEXT_REPORT,
    "Document: product sheet. The Zephyr X2 electric kettle holds 1.7 litres of water and "
    "boils a full jug in about four minutes. Its warranty lasts two years.\n\n" + CONTEXT_EMAILS,
    "Document: server configuration. The application server listens on port 8443 with "
    "four workers, and its database pool holds ten connections.\n\n" + CONTEXT_NOTES,
)
_RAG_SYSTEM = "Answer the question in one sentence, using the documents the user gives."


def rag_reordered() -> Shape:
    """Three retrieved documents, cached in one order, asked about in another."""
    a, b, c = (("user", doc) for doc in _DOCS)
    system = ("system", _RAG_SYSTEM)
    return Shape(
        "rag_reordered",
        stored=(system, a, b, c, ("user", "Summarise the three documents.")),
        target=(system, c, a, b),
        questions=(
            ("Which port does the application server listen on?", "8443"),
            ("How many litres of water does the Zephyr X2 hold?", "1.7"),
        ),
    )


SHAPES = (truncated_history, report_first, shared_block, rag_reordered)
