"""The demos' scenario: a rail company's system prompt, a passenger's uploaded report.

Both demos (``examples/demo.py`` on transformers, ``examples/demo_vllm.py`` on vLLM) play
it with two engines::

    engine 1   [system prompt][question 1][assistant]
                ^ position 0
    engine 2   [uploaded report ~600 tok][system prompt][question 2][assistant]
                                         ^ lands at ~600: prefix caching misses

Segments are chat messages: each message is tokenized on its own, so the system prompt
has the same token ids in both prompts and its chunks the same content keys.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

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
# vLLM's CPU build claims whole 128-token blocks of the prompt, so the vLLM demo's system
# prompt goes on with a station guide (~1k tokens in all): most of engine 2's prompt is
# then reusable, as with a real agent's instructions.
STATION_GUIDE = (
    "Station guide for Pip.\n\n"
    "Larkspur Central has twelve platforms. Platforms 1 to 4 serve the coast line to "
    "Millbrook Harbour, platforms 5 to 8 the valley line to Ashford Junction and Fenwick, "
    "and platforms 9 to 12 the night trains and the airport shuttle. The ticket hall is "
    "on the upper level and opens at 5:00. The left-luggage office is next to platform 1 "
    "and keeps bags for up to seven days, at 4 euros per bag per day.\n\n"
    "Millbrook Harbour station is two minutes on foot from the ferry terminal. The ferry "
    "to Saltmarsh Island leaves at 09:15, 11:00, 14:30 and 18:00. A combined rail and "
    "ferry ticket costs 12 euros more than the rail fare alone and must be bought before "
    "boarding the train. The ferry company accepts a delay certificate from the guard, "
    "which passengers can ask for on any train that runs more than 20 minutes late.\n\n"
    "Ashford Junction is where the valley line meets the coast line. Signal faults there "
    "cause most delays on route R2. Passengers changing trains at Ashford Junction have "
    "at least eight minutes between connections; staff hold a connecting train for up to "
    "five minutes when the arriving train is late. The waiting room on platform 2 is "
    "heated in winter and has a water fountain.\n\n"
    "Fenwick is the busiest change point on the valley line. Lost property found on trains "
    "that pass through Fenwick is sent to the Larkspur Central desk within two days. "
    "Items are kept for three months; after that they are donated to charity. Passengers "
    "who report a lost item with form LL-19 get a reference number by text message.\n\n"
    "Accessibility. Every station on routes R2 and R5 has step-free access. Passengers "
    "who need help boarding can book assistance up to two hours before departure on the "
    "customer line. Wheelchair spaces are in coach A on every train. Guide dogs and "
    "assistance dogs always travel free and need no pet ticket.\n\n"
    "Tickets. Day returns are valid until 04:00 the next morning. A season ticket can be "
    "paused once a year for up to four weeks. Children under five travel free; children "
    "from five to fifteen pay half fare. The family card costs 30 euros a year and gives a "
    "third off adult fares when at least one child travels. Tickets bought on board cost "
    "an extra 3 euros unless the ticket machine at the station was out of order.\n\n"
    "Food and drink. The trolley service runs on trains longer than 40 minutes between "
    "07:00 and 20:00. It sells hot drinks, sandwiches and fruit, and takes cards only. "
    "The cafe at Larkspur Central is open from 05:30 to 22:30. Passengers may bring their "
    "own food on board, but alcohol is not allowed on trains after 21:00.\n\n"
    "Complaints. Written complaints are answered within ten working days. Passengers who "
    "are not satisfied with the answer can ask the independent rail ombudsman to review "
    "the case within two months. Pip never promises compensation beyond the policy above."
)
LONG_SYSTEM_PROMPT = SYSTEM_PROMPT + "\n\n" + STATION_GUIDE
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


def scenario_prompt(
    tokenizer: PreTrainedTokenizerBase,
    role: int,
    quick: bool = False,
    system: str = SYSTEM_PROMPT,
    question: str = QUESTION_2,
) -> ChatPrompt:
    """Engine 1's chat (``role`` 1: system prompt first) or engine 2's (report first,
    then ``question``)."""
    if role not in (1, 2):
        raise ValueError(f"role: must be 1 or 2, got {role!r}")
    system_message = ("system prompt", "system", system)
    if role == 1:
        return chat_prompt(tokenizer, [system_message, ("question", "user", QUESTION_1)])
    paragraphs = REPORT_PARAGRAPHS[:QUICK_REPORT_PARAGRAPHS] if quick else REPORT_PARAGRAPHS
    report = "Here is the trip report I uploaded:\n\n" + "\n\n".join(paragraphs)
    return chat_prompt(
        tokenizer,
        [("uploaded report", "user", report), system_message, ("question", "user", question)],
    )


def print_answers(with_cache: str, without_cache: str) -> bool:
    """Print engine 2's answers with and without the cache; True when they are the same."""
    same = with_cache == without_cache
    for label, answer in (("with", with_cache), ("without", without_cache)):
        print(f"  answer {label} the cache:")
        print(wrap_answer(answer))
    print(f"  same answer with and without the cache: {'yes' if same else 'NO'}")
    print("=" * 100)
    return same


def wrap_answer(text: str) -> str:
    """An answer quoted and wrapped, indented under its label."""
    return textwrap.fill(repr(text), width=96, initial_indent="    ", subsequent_indent="    ")
