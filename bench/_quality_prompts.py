"""Prompts for bench/quality.py: a cached chunk that lands after unrelated context.

Each prompt is three chat segments, tokenized separately so that the chunk's tokens are
the same wherever it lands::

    | unrelated context        | cached chunk (the facts)  | question + assistant header |
    | system + user messages   | one message               | user message                |
      ~250-350 tokens            ~100-250 tokens             ~20-30 tokens

The chunk is what a cache would hold from an earlier request in which it was the first
message (computed from position 0); here it follows the context, so its KV is reused at
a new offset. ``expected`` is a short string the answer must contain to carry the fact
(case-insensitive).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

SYSTEM = "You are a helpful assistant. Answer briefly and use the information given."

CONTEXT_REPORT = (
    "Please keep this report in mind for later.\n\n"
    "Coastal erosion survey, northern district, spring season. The survey team walked "
    "eleven kilometres of shoreline between the old pier and the river mouth. Dune height "
    "fell by an average of forty centimetres since the previous autumn, with the steepest "
    "losses near the car park, where foot traffic has broken the marram grass. Three "
    "storm events in January moved large amounts of sand onto the promenade, and the "
    "council cleared it with two loaders over four days. The team recommends fencing the "
    "worst sections, replanting grass in April, and closing the southern path during "
    "nesting season. Volunteers counted plovers at six sites; numbers were steady at four "
    "sites and lower at two. Water samples near the outfall met the bathing standard on "
    "every date. The next survey is planned for the autumn, after the summer crowds, and "
    "will add drone photographs so that changes in the dune line can be measured more "
    "precisely. Budget for the fencing is still under discussion with the parks office."
)

CONTEXT_EMAILS = (
    "Here is an email thread from last week, for background.\n\n"
    "From: Dana. Subject: office move. Hi all, the movers arrive on Thursday at eight, so "
    "please pack your desks by Wednesday evening and label every box with your name and "
    "the new floor. IT will disconnect the printers on Wednesday afternoon. "
    "From: Sam. Thanks Dana. Will the kitchen stay open on Thursday? Some of us are "
    "coming in early to help. "
    "From: Dana. The kitchen closes on Wednesday at five and reopens on the new floor on "
    "Monday. There will be coffee and pastries in the lobby on Thursday morning. "
    "From: Priya. Quick question about parking: do the new permits start on Monday or "
    "on the first of the month? My old permit runs out soon. "
    "From: Dana. The new permits start on Monday. Facilities will email everyone a "
    "digital copy, and paper permits can be collected at the front desk. "
    "From: Sam. One more thing: the plants on the window sill belong to the whole team, "
    "so please do not pack them into personal boxes. I will carry them myself."
)

CONTEXT_CHAT = (
    "Earlier conversation, kept for context.\n\n"
    "User: I am planning a weekend trip and I cannot decide between the mountains and "
    "the seaside. Assistant: Both are good choices. The mountains are quieter in spring "
    "and the trails are less crowded, while the seaside has more restaurants and things "
    "to do in the evening. User: I like hiking, but my partner prefers swimming. "
    "Assistant: A lake in the hills could suit you both: there are trails around most "
    "lakes and many have places to swim when the water is warm enough. User: That sounds "
    "nice. How warm does the water get in May? Assistant: It depends on the altitude, but "
    "mountain lakes are often still cold in May, around twelve to sixteen degrees, so a "
    "wetsuit helps. User: Then maybe we should wait until July. Assistant: July is "
    "usually the warmest month for lakes, and the trails are dry by then. Booking early "
    "is wise, because small lodges fill up quickly in the summer holidays."
)

CONTEXT_NOTES = (
    "These are my study notes on bread baking, unrelated to what comes next.\n\n"
    "A simple loaf needs flour, water, salt and yeast. Strong flour has more protein, "
    "which builds gluten and gives the crumb its structure. Knead the dough for about "
    "ten minutes, until it is smooth and springs back when pressed. Let it rise in a "
    "warm place until it doubles in size, which takes one to two hours depending on the "
    "temperature of the kitchen. Shape the loaf gently so as not to knock out all the "
    "air, then let it prove again for forty minutes. Bake in a hot oven with a tray of "
    "water on the bottom shelf, since steam helps the crust expand before it sets. A "
    "loaf is done when it sounds hollow when tapped underneath. Sourdough uses a starter "
    "instead of commercial yeast and needs a longer, cooler rise, often overnight in the "
    "fridge, which develops a deeper, more sour flavour. Cool the bread on a rack for an "
    "hour before slicing, or the crumb will be gummy."
)


@dataclass(frozen=True, slots=True)
class QualityPrompt:
    """One quality case: context, cached chunk (one chat message), question, expected fact."""

    name: str
    kind: str
    context: str
    chunk_role: str
    chunk: str
    question: str
    expected: str

    def segments(
        self, tokenizer: PreTrainedTokenizerBase
    ) -> tuple[list[int], list[int], list[int]]:
        """Token ids of the context, the chunk and the question (each tokenized on its own)."""
        context = (
            f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
            f"<|im_start|>user\n{self.context}<|im_end|>\n"
            "<|im_start|>assistant\nNoted.<|im_end|>\n"
        )
        chunk = f"<|im_start|>{self.chunk_role}\n{self.chunk}<|im_end|>\n"
        question = f"<|im_start|>user\n{self.question}<|im_end|>\n<|im_start|>assistant\n"
        return tuple(  # type: ignore[return-value]
            list(tokenizer(text, add_special_tokens=False).input_ids)
            for text in (context, chunk, question)
        )


PROMPTS: tuple[QualityPrompt, ...] = (
    QualityPrompt(
        name="rag_generator",
        kind="RAG facts",
        context=CONTEXT_REPORT,
        chunk_role="user",
        chunk=(
            "Document 7, facilities handbook, section on power. Halvorsen Electric is the "
            "company that services the backup generator of Building C, every March. The "
            "generator sits in the basement plant room, and the service report is filed "
            "with the site manager. In a power cut the generator starts within ten seconds and "
            "can run the lifts, the emergency lighting and the server room for up to "
            "eighteen hours on a full tank. Staff must not store anything in the plant "
            "room, and the door is kept locked; the key is held at reception."
        ),
        question="Which company services the backup generator of Building C?",
        expected="Halvorsen",
    ),
    QualityPrompt(
        name="persona_name",
        kind="chat persona",
        context=CONTEXT_EMAILS,
        chunk_role="system",
        chunk=(
            "You are Pip, the friendly helpdesk assistant of Larkspur Public Library. "
            "Always introduce yourself as Pip. You help visitors find books, renew loans "
            "and book study rooms. The library is open from nine in the morning until "
            "eight in the evening on weekdays, and from ten until four on Saturdays. It "
            "is closed on Sundays. Loans last three weeks and can be renewed twice. "
            "Study rooms can be booked for two hours at a time. Be warm and concise, and "
            "never make up information you were not given."
        ),
        question="Hello! What is your name?",
        expected="Pip",
    ),
    QualityPrompt(
        name="code_retries",
        kind="code",
        context=CONTEXT_NOTES,
        chunk_role="user",
        chunk=(
            "Here is the module we use for HTTP calls:\n\n"
            "```python\n"
            "import time\n"
            "import requests\n\n"
            "MAX_RETRIES = 7\n"
            "BACKOFF_SECONDS = 0.5\n\n"
            "def fetch_with_retry(url):\n"
            "    for attempt in range(MAX_RETRIES):\n"
            "        try:\n"
            "            response = requests.get(url, timeout=10)\n"
            "            response.raise_for_status()\n"
            "            return response.json()\n"
            "        except requests.RequestException:\n"
            "            time.sleep(BACKOFF_SECONDS * 2 ** attempt)\n"
            "    raise RuntimeError('gave up after retries')\n"
            "```"
        ),
        question="What is the value of MAX_RETRIES in the module?",
        expected="7",
    ),
    QualityPrompt(
        name="tool_weather",
        kind="tool result",
        context=CONTEXT_CHAT,
        chunk_role="user",
        chunk=(
            "Tool output from get_weather(city='Porto'):\n"
            '{"city": "Porto", "country": "Portugal", "temperature_c": 23, '
            '"condition": "sunny", "humidity_percent": 61, "wind_kmh": 14, '
            '"sunrise": "06:42", "sunset": "20:51", "forecast": [{"day": "tomorrow", '
            '"high_c": 25, "low_c": 16, "condition": "partly cloudy"}, {"day": "Sunday", '
            '"high_c": 22, "low_c": 15, "condition": "light rain"}]}'
        ),
        question="What is the current temperature in Porto in degrees Celsius?",
        expected="23",
    ),
    QualityPrompt(
        name="story_mare",
        kind="natural text",
        context=CONTEXT_REPORT,
        chunk_role="user",
        chunk=(
            "A short story. Every summer a girl stayed at her grandmother's farm by the "
            "river. The grandmother kept bees, grew tomatoes along the south wall, and "
            "owned an old grey mare. The mare's name was Clementine. Every evening the "
            "girl brushed Clementine and fed her apples from the orchard. One year a "
            "storm flooded the lower field, and Clementine led the sheep to the hill "
            "before anyone else noticed the water rising. After that, the neighbours "
            "said Clementine was the cleverest animal in the valley."
        ),
        question="What was the mare's name?",
        expected="Clementine",
    ),
    QualityPrompt(
        name="rag_kettle",
        kind="RAG facts",
        context=CONTEXT_CHAT,
        chunk_role="user",
        chunk=(
            "Product sheet: Zephyr X2 electric kettle. The Zephyr X2 holds 1.7 litres of "
            "water and boils a full jug in about four minutes. It has a brushed steel "
            "body, a removable limescale filter and a blue light that glows while it "
            "heats. The base rotates fully, so the kettle can be lifted from any angle. "
            "It switches off automatically when the water boils or when the jug is "
            "empty. The warranty lasts two years from the date of purchase."
        ),
        question="How many litres of water does the Zephyr X2 hold?",
        expected="1.7",
    ),
    QualityPrompt(
        name="persona_store",
        kind="chat persona",
        context=CONTEXT_NOTES,
        chunk_role="system",
        chunk=(
            "You are the customer support agent of Nordwind Bikes, a bicycle shop in "
            "Hamburg. Answer questions about opening hours, repairs and rentals. The shop "
            "opens at 10 am and closes at 7 pm from Monday to Saturday. Repairs usually "
            "take two working days. City bikes can be rented for 15 euros per day, and "
            "electric bikes for 35 euros per day. Always be polite and mention that "
            "helmets are included with every rental."
        ),
        question="What time does the shop open?",
        expected="10",
    ),
    QualityPrompt(
        name="tool_calendar",
        kind="tool result",
        context=CONTEXT_EMAILS,
        chunk_role="user",
        chunk=(
            "Tool output from calendar.search(query='quarterly review'):\n"
            '{"results": [{"title": "Quarterly review", "date": "2024-05-14", '
            '"time": "14:30", "room": "Orion", "organizer": "Dana Whitfield", '
            '"attendees": ["Sam", "Priya", "Lena", "Marco"], "duration_minutes": 90, '
            '"notes": "Bring the sales figures and the hiring plan."}]}'
        ),
        question="Which room is the quarterly review in?",
        expected="Orion",
    ),
    QualityPrompt(
        name="code_port",
        kind="code",
        context=CONTEXT_CHAT,
        chunk_role="user",
        chunk=(
            "This is our server configuration file:\n\n"
            "```yaml\n"
            "server:\n"
            "  host: 0.0.0.0\n"
            "  port: 8443\n"
            "  workers: 4\n"
            "  tls:\n"
            "    cert: /etc/ssl/app.pem\n"
            "    key: /etc/ssl/app.key\n"
            "logging:\n"
            "  level: info\n"
            "  file: /var/log/app.log\n"
            "database:\n"
            "  url: postgres://db.internal:5432/app\n"
            "  pool_size: 10\n"
            "```"
        ),
        question="Which port does the server listen on, according to the configuration?",
        expected="8443",
    ),
    QualityPrompt(
        name="notes_launch",
        kind="natural text",
        context=CONTEXT_EMAILS,
        chunk_role="user",
        chunk=(
            "Minutes of the product meeting. Attendees: Lena, Marco, Priya and Tom. The "
            "team reviewed the beta feedback, which was mostly positive, although several "
            "users found the onboarding too long. Marco will shorten the onboarding to "
            "three screens. Because the payment provider needs more time for testing, the "
            "team decided to move the launch to October 12. Priya will update the press "
            "plan, and Tom will tell the support team about the new date."
        ),
        question="To which date was the launch moved?",
        expected="October 12",
    ),
)
