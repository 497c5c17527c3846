"""Synthetic multi-turn agent traces over varied text, for the hit-rate benchmark.

A trace is a list of :class:`Request`; a request is a list of :class:`Segment` (system
prompt, user and assistant messages, documents, tool results), so its segment
boundaries are known. Four situations, each its own deployment:

- ``multi_turn``: plain chats; each request appends a reply and a new user turn.
- ``truncated_history``: long chats under a context budget; the oldest turns are dropped
  and everything after the system prompt shifts left.
- ``document_first``: users upload a report that sits *before* the system prompt.
- ``shared_instructions``: several agents with personas of different lengths share one
  instruction block, the task and each other's tool results at different offsets.

Text comes from :class:`Corpus`: prose on eight topics, Python snippets, JSON tool
results, and reports with tables, all drawn from a seeded ``random.Random`` (never from
``hash()`` or set order), so a seed gives the same trace in every process.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

ROLES = ("system", "user", "assistant", "tool")

TOPICS: dict[str, dict[str, list[str]]] = {
    "astronomy": {
        "noun": ["telescope", "nebula", "exoplanet", "spectrograph", "light curve", "pulsar",
                 "redshift survey", "dust lane", "transit", "star cluster", "quasar", "orbit"],
        "verb": ["observed", "resolved", "modelled", "catalogued", "calibrated", "imaged"],
        "adj": ["faint", "distant", "ionised", "variable", "binary", "infrared", "metal-poor"],
        "unit": ["parsecs", "arcseconds", "kelvin", "solar masses", "light-years"],
    },
    "cooking": {
        "noun": ["sourdough starter", "braise", "roux", "brine", "stock", "custard", "glaze",
                 "marinade", "dumpling dough", "reduction", "spice blend", "pickle"],
        "verb": ["simmered", "folded", "seared", "proofed", "whisked", "rested", "toasted"],
        "adj": ["caramelised", "silky", "acidic", "smoky", "crisp", "fermented", "tender"],
        "unit": ["grams", "minutes", "degrees Celsius", "millilitres", "servings"],
    },
    "finance": {
        "noun": ["bond ladder", "cash flow", "margin", "hedge", "invoice backlog", "ledger",
                 "dividend", "yield curve", "budget line", "forecast", "audit trail", "loan"],
        "verb": ["reconciled", "forecast", "rebalanced", "audited", "amortised", "priced"],
        "adj": ["quarterly", "deferred", "variable-rate", "net", "operating", "accrued"],
        "unit": ["basis points", "euros", "percent", "days", "million dollars"],
    },
    "medicine": {
        "noun": ["biopsy", "dosage", "cohort", "biomarker", "triage queue", "infusion",
                 "vaccine trial", "lesion", "blood panel", "clinic", "protocol", "scan"],
        "verb": ["screened", "titrated", "diagnosed", "monitored", "enrolled", "referred"],
        "adj": ["chronic", "acute", "randomised", "paediatric", "benign", "elevated"],
        "unit": ["milligrams", "patients", "weeks", "mmHg", "percent"],
    },
    "operations": {
        "noun": ["deployment", "load balancer", "incident", "replica", "queue depth",
                 "rollback", "canary", "dashboard", "pager rotation", "disk volume",
                 "certificate", "runbook"],
        "verb": ["restarted", "drained", "patched", "scaled", "paged", "migrated", "throttled"],
        "adj": ["degraded", "stale", "regional", "idle", "saturated", "healthy", "flaky"],
        "unit": ["milliseconds", "requests per second", "gigabytes", "nodes", "hours"],
    },
    "history": {
        "noun": ["treaty", "archive", "dynasty", "trade route", "census", "manuscript",
                 "harbour", "guild", "fortress", "chronicle", "charter", "expedition"],
        "verb": ["signed", "recorded", "besieged", "founded", "translated", "abandoned"],
        "adj": ["medieval", "coastal", "imperial", "forgotten", "contested", "illuminated"],
        "unit": ["years", "leagues", "ships", "villages", "volumes"],
    },
    "gardening": {
        "noun": ["raised bed", "compost heap", "seedling", "hedge", "irrigation line",
                 "mulch", "orchard", "greenhouse", "tuber", "cover crop", "trellis", "pond"],
        "verb": ["pruned", "sowed", "watered", "grafted", "transplanted", "harvested"],
        "adj": ["perennial", "drought-tolerant", "shaded", "loamy", "frost-hardy", "wild"],
        "unit": ["centimetres", "litres", "plants", "square metres", "days"],
    },
    "law": {
        "noun": ["contract", "clause", "appeal", "deposition", "statute", "licence", "tenancy",
                 "settlement", "warranty", "filing", "jurisdiction", "precedent"],
        "verb": ["drafted", "amended", "challenged", "ratified", "waived", "enforced"],
        "adj": ["binding", "ambiguous", "retroactive", "exclusive", "standard", "void"],
        "unit": ["days", "pages", "parties", "euros", "months"],
    },
}  # fmt: skip

NAMES = ["Ada", "Bruno", "Chiara", "Dmitri", "Esi", "Farah", "Goran", "Hana", "Ines"]
NAMES += ["Jonas", "Kofi", "Lena", "Mateo", "Noor", "Oskar", "Priya", "Quentin", "Rosa"]
NAMES += ["Sven", "Tariq", "Uma", "Viktor", "Wen", "Ximena", "Yusuf", "Zofia"]
PLACES = ["Lisbon", "Nairobi", "Osaka", "Quito", "Tallinn", "Hobart", "Tromso", "Accra"]
PLACES += ["Valparaiso", "Leipzig", "Da Nang", "Halifax", "Tbilisi", "Cusco"]
CONNECTIVES = ["However,", "Meanwhile,", "As a result,", "In practice,", "Notably,"]
CONNECTIVES += ["By contrast,", "Later that week,", "According to the notes,", "Even so,"]

# Sentence shapes; slots are filled per sentence, so a shape rarely repeats verbatim
# over 16 tokens (which would make unrelated segments look content-identical).
SHAPES = [
    "{Name} {verb} the {adj} {noun} in {place} and counted {num} {unit}.",
    "The {noun} was {verb} twice because the {adj2} {noun2} looked wrong.",
    "{Conn} {name} noted that {num} {unit} is {cmp} than the {adj} {noun} suggested.",
    "Nobody expected the {noun} near {place} to be so {adj}; {name} {verb} it anyway.",
    "With {num} {unit} to spare, the {adj} {noun} and the {noun2} were {verb} by noon.",
    "{Conn} the {noun2} in {place} stayed {adj2} for {num} {unit}.",
    "Is the {adj} {noun} worth {num} {unit}? {Name} thinks the {noun2} says otherwise.",
    "{Name} and {name2} {verb} a {adj} {noun} after reading {num} reports from {place}.",
]


def _fill(rng: random.Random, topic: str, shape: str) -> str:
    bank = TOPICS[topic]
    name, name2 = rng.sample(NAMES, 2)
    noun, noun2 = rng.sample(bank["noun"], 2)
    adj, adj2 = rng.sample(bank["adj"], 2)
    num = rng.choice([str(rng.randint(2, 999)), f"{rng.uniform(0.1, 99):.1f}"])
    return shape.format(
        Name=name,
        name=name,
        name2=name2,
        noun=noun,
        noun2=noun2,
        adj=adj,
        adj2=adj2,
        verb=rng.choice(bank["verb"]),
        unit=rng.choice(bank["unit"]),
        num=num,
        place=rng.choice(PLACES),
        Conn=rng.choice(CONNECTIVES),
        cmp=rng.choice(["larger", "smaller", "slower", "riskier", "cheaper"]),
    )


@dataclass(frozen=True, slots=True)
class Segment:
    """One piece of a prompt (a chat message, a document, a tool result)."""

    role: str
    text: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"Segment.role must be one of {ROLES}, got {self.role!r}")
        if not self.text:
            raise ValueError("Segment.text must be non-empty")

    def rendered(self) -> str:
        """The segment in SmolLM2's ChatML form."""
        # The special tokens at both ends stop BPE merges across segments, so a segment
        # tokenizes to the same ids wherever it sits.
        return f"<|im_start|>{self.role}\n{self.text}<|im_end|>\n"


@dataclass(frozen=True, slots=True)
class Request:
    """One prompt of a trace: its situation and its segments in order."""

    situation: str
    segments: tuple[Segment, ...]

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError("Request.segments must be non-empty")


class Corpus:
    """Seeded generator of varied text: prose, code, JSON tool results, reports."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def topic(self) -> str:
        """A random topic name."""
        return self.rng.choice(sorted(TOPICS))

    def paragraph(self, topic: str, sentences: int) -> str:
        """A paragraph of ``sentences`` sentences on ``topic``."""
        return " ".join(_fill(self.rng, topic, self.rng.choice(SHAPES)) for _ in range(sentences))

    def table(self, topic: str, rows: int) -> str:
        """A markdown table of made-up measurements."""
        bank = TOPICS[topic]
        cols = ["item", "site", self.rng.choice(bank["unit"]), "change", "owner"]
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for noun in self.rng.sample(bank["noun"], rows):
            amount = f"{self.rng.uniform(1, 5000):.2f}"
            change = f"{self.rng.uniform(-30, 30):+.1f}%"
            cells = [noun, self.rng.choice(PLACES), amount, change, self.rng.choice(NAMES)]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def document(self, topic: str, sections: int) -> str:
        """A report: title, sections of prose, one table."""
        adj = self.rng.choice(TOPICS[topic]["adj"]).title()
        title = f"# {adj} {topic} review, {self.rng.choice(PLACES)}"
        parts = [title, f"Prepared by {self.rng.choice(NAMES)} ({self.rng.randint(2019, 2026)})."]
        for i in range(sections):
            noun = self.rng.choice(TOPICS[topic]["noun"])
            parts.append(f"## {i + 1}. On the {noun}")
            parts.append(self.paragraph(topic, self.rng.randint(3, 6)))
            if i == sections // 2:
                parts.append(self.table(topic, self.rng.randint(3, 6)))
        return "\n\n".join(parts)

    def code(self) -> str:
        """A short Python snippet: a loop, a class, or error handling (random names)."""
        rng = self.rng
        verb = rng.choice(["load", "merge", "score", "filter", "rank", "parse", "batch", "dedupe"])
        obj = rng.choice(["orders", "events", "samples", "tickets", "readings", "rows", "jobs"])
        key = rng.choice(["id", "ts", "weight", "region", "label", "size", "owner", "due"])
        a, b = rng.randint(2, 500), rng.randint(1, 97)
        shape = rng.randrange(3)
        if shape == 0:
            return (
                f"def {verb}_{obj}({obj}: list[dict], limit: int = {a}) -> list[dict]:\n"
                f'    """{verb.title()} {obj} by {key!r}, keeping at most {a}."""\n'
                f"    out = []\n"
                f"    for i, item in enumerate(sorted({obj}, key=lambda r: r[{key!r}])):\n"
                f"        if i >= limit:\n"
                f"            break\n"
                f"        item[{key!r}] = item.get({key!r}, {b}) {rng.choice('+*-')} {b + a}\n"
                f"        out.append(item)\n"
                f"    return out\n"
            )
        if shape == 1:
            cls = f"{obj.title().rstrip('s')}{rng.choice(['Cache', 'Queue', 'Index', 'Pool'])}"
            return (
                f"class {cls}:\n"
                f"    def __init__(self, capacity: int = {a}) -> None:\n"
                f"        self.capacity = capacity\n"
                f"        self.{obj} = {{}}\n\n"
                f"    def {verb}(self, {key}: str, value: float) -> bool:\n"
                f"        if len(self.{obj}) >= self.capacity:\n"
                f"            return False\n"
                f"        self.{obj}[{key}] = value * {b}\n"
                f"        return True\n"
            )
        exc = rng.choice(["KeyError", "ValueError", "TimeoutError", "OSError"])
        return (
            f"try:\n"
            f"    {obj} = client.{verb}({key}={a!r}, retries={b % 7 + 1})\n"
            f"except {exc} as err:\n"
            f"    log.warning('{verb} {obj} failed: %s', err)\n"
            f"    {obj} = []\n"
        )

    def tool_result(self, topic: str) -> str:
        """A JSON tool result (search hits, a database query or a metrics read-out)."""
        rng = self.rng
        kind = rng.choice(["search", "sql", "metrics"])
        bank = TOPICS[topic]
        body: dict[str, object] = {"tool": {"search": "web_search"}.get(kind, kind)}
        if kind == "search":
            body["query"] = f"{rng.choice(bank['adj'])} {rng.choice(bank['noun'])}"
            body["results"] = [
                {
                    "title": f"{rng.choice(bank['noun']).title()} notes {rng.randint(1, 99)}",
                    "url": f"https://example.org/{topic}/{rng.randint(1000, 9999)}",
                    "snippet": _fill(rng, topic, rng.choice(SHAPES)),
                }
                for _ in range(rng.randint(2, 4))
            ]
        elif kind == "sql":
            body["query"] = f"SELECT * FROM {topic} WHERE score > {rng.randint(1, 90)}"
            body["rows"] = [
                {
                    "id": rng.randint(1, 10**6),
                    "name": rng.choice(NAMES),
                    "item": rng.choice(bank["noun"]),
                    "value": round(rng.uniform(0, 1e4), 2),
                }
                for _ in range(rng.randint(3, 6))
            ]
        else:
            body["window"] = f"{rng.randint(1, 48)}h"
            body["series"] = {
                f"{rng.choice(bank['noun'])}_{i}": [round(rng.uniform(0, 100), 1) for _ in range(6)]
                for i in range(rng.randint(2, 4))
            }
        return json.dumps(body, indent=1)

    def question(self, topic: str) -> str:
        """A user turn: a question, sometimes with a pasted snippet."""
        rng = self.rng
        bank = TOPICS[topic]
        opener = rng.choice(["Can you explain", "Why did", "How should we handle", "What caused"])
        subject = f"{rng.choice(bank['adj'])} {rng.choice(bank['noun'])}"
        where = f"{rng.choice(['in', 'near', 'for'])} {rng.choice(PLACES)}"
        q = f"{opener} the {subject} {where}? {self.paragraph(topic, rng.randint(1, 2))}"
        if rng.random() < 0.2:
            q += f"\n\n```python\n{self.code()}```"
        return q

    def answer(self, topic: str) -> str:
        """An assistant turn: prose, sometimes with code."""
        text = self.paragraph(topic, self.rng.randint(3, 7))
        if self.rng.random() < 0.25:
            text += f"\n\nHere is a sketch:\n\n```python\n{self.code()}```"
        return text

    def system_prompt(self, role_name: str, topic: str, rules: int) -> str:
        """A persona system prompt with numbered rules."""
        lines = [
            f"You are {role_name}, an assistant for a team working on {topic}.",
            self.paragraph(topic, 2),
            "Rules:",
        ]
        for i in range(rules):
            lines.append(f"{i + 1}. {_fill(self.rng, topic, self.rng.choice(SHAPES))}")
        return "\n".join(lines)

    def instruction_block(self) -> str:
        """The long instruction block several agents share: tool protocol and schemas."""
        tools = []
        for name in ["web_search", "sql", "metrics", "run_python", "read_file", "write_file"]:
            names = self.rng.sample(["query", "path", "limit", "window", "code", "dry_run"], 3)
            params = {
                p: {
                    "type": self.rng.choice(["string", "integer", "boolean"]),
                    "description": _fill(self.rng, self.topic(), self.rng.choice(SHAPES)),
                }
                for p in names
            }
            tools.append({"name": name, "parameters": params})
        steps = "\n".join(f"- {_fill(self.rng, self.topic(), s)}" for s in SHAPES[:6])
        return (
            "## Shared operating instructions (all agents)\n"
            "Call tools by answering with one JSON object per line. Available tools:\n"
            f"{json.dumps(tools, indent=1)}\n\nWorking notes from previous incidents:\n{steps}"
        )


Measure = Callable[[Segment], int]
"""Returns a segment's length in tokens (the truncation budget is in tokens)."""


def multi_turn(corpus: Corpus, conversations: int = 4, turns: int = 6) -> list[Request]:
    """Plain chats: every request is the previous one plus a reply and a new user turn."""
    out: list[Request] = []
    for c in range(conversations):
        topic = corpus.topic()
        history = [Segment("system", corpus.system_prompt(f"helper-{c}", topic, 6))]
        for _ in range(turns):
            history.append(Segment("user", corpus.question(topic)))
            if corpus.rng.random() < 0.3:
                history.append(Segment("tool", corpus.tool_result(topic)))
            out.append(Request("multi_turn", tuple(history)))
            history.append(Segment("assistant", corpus.answer(topic)))
    return out


def truncated_history(
    corpus: Corpus, measure: Measure, conversations: int = 3, turns: int = 14, budget: int = 1536
) -> list[Request]:
    """Long chats under a token budget: keep the system prompt, drop the oldest turns."""
    out: list[Request] = []
    for c in range(conversations):
        topic = corpus.topic()
        system = Segment("system", corpus.system_prompt(f"archivist-{c}", topic, 8))
        turns_so_far: list[list[Segment]] = []
        for _ in range(turns):
            turn = [Segment("user", corpus.question(topic))]
            if corpus.rng.random() < 0.3:
                turn.append(Segment("tool", corpus.tool_result(topic)))
            turns_so_far.append(turn)
            # Drop whole turns from the front until the prompt fits (the newest always stays).
            kept = list(turns_so_far)
            while (
                len(kept) > 1
                and measure(system) + sum(measure(s) for t in kept for s in t) > budget
            ):
                kept.pop(0)
            out.append(Request("truncated_history", (system, *(s for t in kept for s in t))))
            turn.append(Segment("assistant", corpus.answer(topic)))
    return out


def document_first(corpus: Corpus, users: int = 6) -> list[Request]:
    """Uploaded reports placed before the system prompt, with follow-ups and re-use."""
    out: list[Request] = []
    topic = corpus.topic()
    system = Segment("system", corpus.system_prompt("analyst", topic, 7))
    other = Segment("system", corpus.system_prompt("summariser", topic, 4))
    # The assistant is used normally first: its system prompt is cached at position 0.
    out.append(Request("document_first", (system, Segment("user", corpus.question(topic)))))
    out.append(Request("document_first", (other, Segment("user", corpus.question(topic)))))
    docs: list[Segment] = []
    for _ in range(users):
        doc = Segment(
            "user", "Uploaded report:\n\n" + corpus.document(topic, corpus.rng.randint(3, 5))
        )
        docs.append(doc)
        first = (doc, system, Segment("user", corpus.question(topic)))
        out.append(Request("document_first", first))
        # A follow-up in the same chat extends the prompt: an exact-prefix case.
        follow = (
            *first,
            Segment("assistant", corpus.answer(topic)),
            Segment("user", corpus.question(topic)),
        )
        out.append(Request("document_first", follow))
        if len(docs) >= 2:
            # Another user uploads an earlier report to the other assistant.
            old = corpus.rng.choice(docs[:-1])
            out.append(
                Request("document_first", (old, other, Segment("user", corpus.question(topic))))
            )
    return out


def shared_instructions(corpus: Corpus, tasks: int = 5) -> list[Request]:
    """Agents with personas of different lengths share instructions, tasks and tool output."""
    out: list[Request] = []
    block = Segment("system", corpus.instruction_block())
    # Rule counts differ so that the personas, and the offsets after them, differ.
    roster = [("planner", 2), ("researcher", 5), ("coder", 3), ("reviewer", 8)]
    agents = [
        (name, Segment("system", corpus.system_prompt(name, corpus.topic(), rules)))
        for name, rules in roster
    ]
    for t in range(tasks):
        topic = corpus.topic()
        task = Segment("user", f"Task {t + 1}: " + corpus.question(topic))
        finding = Segment("tool", corpus.tool_result(topic))
        memory: list[Segment] = []
        for name, persona in agents:
            if name == "coder":
                # The coder gets the research notes quoted inside its own message, so
                # only content-defined chunking inside the segment can find them.
                note = Segment(
                    "user", f"Research notes for you:\n{finding.text}\nPlease write the code."
                )
                context = [m for m in memory if m is not finding]
                out.append(Request("shared_instructions", (persona, block, task, *context, note)))
            else:
                out.append(Request("shared_instructions", (persona, block, *memory, task)))
            if name == "researcher":
                # The researcher's agent loop: a tool call, then the same prompt extended
                # by the call and its result.
                call = Segment("assistant", json.dumps({"call": "lookup", "task": t + 1}))
                out.append(
                    Request("shared_instructions", (persona, block, *memory, task, call, finding))
                )
                memory.append(finding)
            memory.append(Segment("assistant", corpus.answer(topic)))
    return out


SITUATIONS = ("multi_turn", "truncated_history", "document_first", "shared_instructions")


def build_trace(seed: int, measure: Measure) -> dict[str, list[Request]]:
    """All four situations, each from its own seeded corpus (so each is reproducible alone)."""
    return {
        "multi_turn": multi_turn(Corpus(seed)),
        "truncated_history": truncated_history(Corpus(seed + 1), measure),
        "document_first": document_first(Corpus(seed + 2)),
        "shared_instructions": shared_instructions(Corpus(seed + 3)),
    }
