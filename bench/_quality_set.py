"""The evaluation set of bench/quality.py: 61 prompts in ten kinds, a tuning and a report half.

Every prompt is ``context | cached chunk(s) | question``. The context (a conversation so
far) is an exact-prefix hit; the chunks come from the cache at a new offset; the
question is a miss. How the chunks got into the cache depends on the kind:

==============  ==========================================================================
kind            what is cached, and how
==============  ==========================================================================
facts           one document holding a named fact, cached on its own
numbers         one document with exact numbers and dates, cached on its own
similar         one document about two or three look-alike entities, cached on its own
long            one 400-1000-token document, the fact somewhere inside, cached on its own
language        one document in French, German, Spanish, Italian or Dutch
json            one tool result (JSON), cached on its own
reorder         three look-alike documents, cached in another order (together after a
                system message, or each on its own), reused in a new order
after_context   one document cached inside an earlier request, after other text
chat            whole chat messages (``<|im_start|>role ... <|im_end|>``), cached on their own
multi_doc       two documents, each holding half the answer (the answer must hold both);
                cached each on its own, or together inside an earlier request in the
                other order (``_quality_more.py``)
==============  ==========================================================================

Within each kind prompts alternate between the halves (``tune``, ``report``; the first
prompt of every other kind goes to ``report``), so each half has every kind. Policy
choices are made on the ``tune`` half only; docs/results/quality.md reports the ``report`` half.
``expected`` (and ``also``) are strings the answer must contain to carry the fact
(case-insensitive); bench/_quality_eval.py counts a prompt's fact only where the full
prefill's answer holds it by a clear margin (``FACT_MARGIN``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from _quality_more import AFTER_MORE, JSON_MORE, MULTI_DOC
from _quality_prompts import CONTEXT_CHAT, CONTEXT_EMAILS, CONTEXT_NOTES, CONTEXT_REPORT

Half = Literal["tune", "report"]

CONTEXT_GARDEN = (
    "Some notes from my allotment diary, just for background.\n\n"
    "The beans went in late this year because of the frost in May, but they caught up "
    "quickly once the weather turned warm. The courgettes produced far more than we could "
    "eat, so most of them went to the neighbours. Slugs ate the first two rows of lettuce; "
    "copper tape around the raised beds helped a little. The compost bin is finally "
    "full of dark, crumbly soil after two years. Next spring I want to try growing sweet "
    "potatoes under a cloche and to move the strawberries to the sunnier corner near the "
    "shed. The water butt ran dry in August, so I plan to add a second one on the other "
    "side of the greenhouse. The committee reminded everyone that bonfires are only "
    "allowed on Sundays before ten in the morning."
)

CONTEXTS = (CONTEXT_REPORT, CONTEXT_EMAILS, CONTEXT_CHAT, CONTEXT_NOTES, CONTEXT_GARDEN)

FILLER = (
    "The document continues with general information. Staff are reminded that visitors "
    "must sign in at reception and wear a badge at all times. Fire doors must be kept "
    "closed, and the assembly point is the car park behind the main building. First aid "
    "kits are kept in every kitchen, and the names of the trained first aiders are on the "
    "notice board next to the lifts.",
    "Meeting rooms can be booked through the intranet up to four weeks in advance. Please "
    "cancel a booking you no longer need, so that colleagues can use the room, and leave "
    "the room tidy for the next group. Whiteboard markers and spare cables are in the "
    "cupboard by the stairs.",
    "The cleaning team works in the evenings from Monday to Friday. Desks should be "
    "cleared at the end of each day, and personal items should be stored in the lockers. "
    "Lost property is kept at reception for one month and then donated to charity.",
    "Travel must be approved by a line manager before any tickets are booked. Economy "
    "class is the default for trips under six hours. Receipts for meals and taxis must be "
    "uploaded within thirty days, and claims without receipts cannot be reimbursed.",
    "The building's heating runs from October to April. If a room is too cold or too hot, "
    "report it to the facilities desk rather than opening windows, because the "
    "ventilation system is balanced for closed windows. Portable heaters are not allowed.",
    "Bicycles can be parked in the covered racks next to the side entrance. Showers and "
    "changing rooms are on the ground floor. The racks are locked at night, so please "
    "collect your bicycle before ten in the evening.",
    "All laptops must be encrypted and locked when left unattended. Passwords must never "
    "be shared, and suspicious emails should be reported to the security team using the "
    "button in the mail client. Software can only be installed from the company catalogue.",
    "The canteen serves breakfast from eight until ten and lunch from twelve until two. A "
    "vegetarian option is available every day, and allergens are listed on the menu. "
    "Reusable cups get a small discount on hot drinks.",
    "Parking spaces are allocated by the facilities team. Electric vehicle chargers are "
    "available on the lower level and should be vacated once the car is charged. Visitor "
    "spaces must be booked at least one day in advance.",
    "Holiday requests should be entered in the HR system at least two weeks in advance. "
    "Up to five unused days can be carried over into the next year. Sick leave must be "
    "reported to the line manager before ten in the morning on the first day.",
)


@dataclass(frozen=True, slots=True)
class EvalPrompt:
    """One case: the context, the cached chunks in prompt order, the question, the fact.

    ``cached_after``: the chunks were cached inside an earlier request, after this text
    (in ``cached_order``, indexes into ``chunks``), not on their own. ``chat``: each chunk
    is a whole chat message in ``roles``; otherwise the chunks are raw text inside one
    user message, after a ``<|im_start|>user`` header that is a miss.
    """

    name: str
    kind: str
    half: Half
    context: str
    chunks: tuple[str, ...]
    question: str
    expected: str
    cached_after: str = ""
    cached_order: tuple[int, ...] = ()
    chat: bool = False
    roles: tuple[str, ...] = ()
    also: tuple[str, ...] = ()
    """More strings the answer must hold (a question that needs two documents)."""

    @property
    def facts(self) -> tuple[str, ...]:
        """Every string the answer must hold to carry the fact."""
        return (self.expected, *self.also)

    def holds(self, text: str) -> bool:
        """Whether ``text`` carries the fact (case-insensitive)."""
        return all(f.lower() in text.lower() for f in self.facts)


def _long(head: str, fact: str, at: int, paragraphs: int) -> str:
    body = list(FILLER[:paragraphs])
    body.insert(at, fact)
    return head + "\n\n" + "\n\n".join(body)


# (name, chunk, question, expected) per kind; contexts rotate through CONTEXTS.
_FACTS = (
    (
        "generator",
        "Facilities handbook, power section. Halvorsen Electric services the backup "
        "generator of Building C every March. The generator sits in the basement plant room "
        "and can run the lifts and the emergency lighting for eighteen hours.",
        "Which company services the backup generator of Building C?",
        "Halvorsen",
    ),
    (
        "mare",
        "A short story. Every summer a girl stayed at her grandmother's farm by the "
        "river. The grandmother kept bees and owned an old grey mare named Clementine. Every "
        "evening the girl brushed Clementine and fed her apples from the orchard.",
        "What was the name of the grey mare?",
        "Clementine",
    ),
    (
        "bridge",
        "Local history leaflet. The stone bridge over the Aller was designed by the "
        "engineer Margarethe Voss and opened to carts in the spring of the same year the mill "
        "burned down. It has five arches and is the oldest crossing in the district.",
        "Who designed the stone bridge over the Aller?",
        "Voss",
    ),
    (
        "mascot",
        "School newsletter. This year's sports day was a great success. The new "
        "team mascot, a knitted badger called Bramble, was carried at the front of the "
        "parade by the youngest class, and the relay was won by the blue house.",
        "What is the name of the new team mascot?",
        "Bramble",
    ),
    (
        "ship",
        "Museum guide, hall two. The model in the glass case is the research ship "
        "Aurora Borealis, which mapped the northern sea floor for eleven years. Its captain "
        "for most of those years was Ingrid Solberg, whose logbooks are shown beside it.",
        "Who was the captain of the research ship?",
        "Solberg",
    ),
)
_NUMBERS = (
    (
        "invoice",
        "Invoice 20-4471 from Brightline Supplies. Office chairs, 12 units. "
        "Delivery charge included. Total due: 4,382.17 euros, payable by bank transfer "
        "within thirty days of the invoice date.",
        "What is the total amount due on the invoice?",
        "4,382.17",
    ),
    (
        "founded",
        "About us. The Kestrel Rowing Club was founded on 14 March 1921 by six "
        "dock workers who wanted to race on the canal. Today it has over three hundred "
        "members and trains on the river every morning.",
        "On what date was the Kestrel Rowing Club founded?",
        "14 March 1921",
    ),
    (
        "flight",
        "Booking confirmation. Flight LX 1327 from Zurich to Lisbon departs on "
        "22 June at 07:45 from gate B12 and lands at 09:35 local time. Checked baggage "
        "allowance: one bag of 23 kg.",
        "At what time does the flight depart?",
        "07:45",
    ),
    (
        "recipe",
        "Grandmother's plum cake. Mix 250 grams of flour with 180 grams of butter "
        "and 120 grams of sugar. Bake at 175 degrees for 55 minutes, then leave it to cool "
        "in the tin.",
        "For how many minutes is the cake baked?",
        "55",
    ),
    (
        "census",
        "Village report. At the last count the village of Hollowmere had 2,318 "
        "inhabitants, 94 more than ten years earlier. The school has 140 pupils and the "
        "library is open three days a week.",
        "How many inhabitants does Hollowmere have?",
        "2,318",
    ),
)
_SIMILAR = (
    (
        "annas",
        "Team directory. Anna Berg leads the marketing team on the second floor. "
        "Anna Borg leads the finance team on the fourth floor. Both joined the company in "
        "the same year and are often confused by new staff.",
        "Which team does Anna Borg lead?",
        "finance",
    ),
    (
        "twins",
        "Family news. The twins Tomas and Tobias Lind started university this "
        "autumn. Tomas is studying chemistry in Uppsala, while Tobias chose history in Lund. "
        "They plan to meet at home every second weekend.",
        "What is Tobias studying?",
        "history",
    ),
    (
        "cafes",
        "Street guide. Cafe Mira on Elm Street closes at six and is known for its "
        "cheesecake. Cafe Myra on Oak Street closes at nine and is known for its hot "
        "chocolate.",
        "What is Cafe Myra known for?",
        "hot chocolate",
    ),
    (
        "servers",
        "Inventory. The server atlas-01 runs the billing database and sits in "
        "rack 4. The server atlas-10 runs the mail gateway and sits in rack 7. The server "
        "atlas-11 runs the build system and sits in rack 9.",
        "What does atlas-10 run?",
        "mail",
    ),
    (
        "rivers",
        "Geography notes. The river Tanne rises in the eastern hills and flows "
        "into Lake Orsa. The river Tanna rises in the western forest and flows into the "
        "sea at Port Hale.",
        "Where does the river Tanna flow into the sea?",
        "Port Hale",
    ),
)
_LONG = (
    (
        "handbook_wifi",
        _long(
            "Employee handbook, general section.",
            "The guest wifi "
            "network is called Meadowlark and its password changes every Monday; the current "
            "password is printed on the card at reception.",
            3,
            6,
        ),
        "What is the name of the guest wifi network?",
        "Meadowlark",
    ),
    (
        "handbook_nurse",
        _long(
            "Employee handbook, health and safety.",
            "The company nurse, "
            "Rosalind Achebe, holds a clinic on Tuesdays and Thursdays in room 014 on the ground "
            "floor.",
            5,
            8,
        ),
        "Who is the company nurse?",
        "Achebe",
    ),
    (
        "handbook_safe",
        _long(
            "Employee handbook, security.",
            "The code of the key safe in "
            "the post room is 7391; it is changed whenever someone leaves the team.",
            1,
            7,
        ),
        "What is the code of the key safe?",
        "7391",
    ),
    (
        "handbook_van",
        _long(
            "Employee handbook, transport.",
            "The delivery van is serviced by Okafor Motors in Dunmore every six months.",
            7,
            10,
        ),
        "Which garage services the delivery van?",
        "Okafor",
    ),
    (
        "handbook_award",
        _long(
            "Employee handbook, recognition.",
            "Last year the "
            "colleague of the year award went to Priscilla Fenwick from the logistics team.",
            4,
            9,
        ),
        "Who won the colleague of the year award last year?",
        "Fenwick",
    ),
)
_LANGUAGE = (
    (
        "fr_boulangerie",
        "La boulangerie du village ouvre a sept heures. Le boulanger "
        "s'appelle Gaspard Moreau et il prepare chaque matin quarante baguettes et des "
        "croissants au beurre. Le lundi, la boutique est fermee.",
        "Comment s'appelle le boulanger ?",
        "Moreau",
    ),
    (
        "de_museum",
        "Das Stadtmuseum zeigt ab Mai eine Ausstellung uber alte Uhren. Die "
        "Kuratorin heisst Henrike Albers. Der Eintritt kostet acht Euro, fur Kinder ist er "
        "frei.",
        "Wie heisst die Kuratorin?",
        "Albers",
    ),
    (
        "es_tren",
        "El tren a Sevilla sale del anden cuatro a las nueve y media. El viaje "
        "dura dos horas y cuarto. El revisor de hoy se llama Esteban Ruiz y habla tres "
        "idiomas.",
        "Como se llama el revisor?",
        "Ruiz",
    ),
    (
        "it_vino",
        "La cantina della famiglia Bellini produce un vino rosso chiamato "
        "Collerosso. Le vigne si trovano sulle colline vicino a Siena e la vendemmia "
        "comincia a settembre.",
        "Come si chiama il vino rosso della cantina?",
        "Collerosso",
    ),
    (
        "nl_fiets",
        "De fietsenmaker in de Kerkstraat heet Joost Verhoeven. Hij repareert "
        "fietsen van maandag tot zaterdag en een nieuwe band kost vijftien euro.",
        "Hoe heet de fietsenmaker?",
        "Verhoeven",
    ),
)
_JSON = (
    (
        "weather",
        'Tool output from get_weather(city="Porto"):\n{"city": "Porto", '
        '"temperature_c": 23, "condition": "sunny", "humidity_percent": 61, "wind_kmh": 14, '
        '"sunset": "20:51"}',
        "What is the current temperature in Porto in degrees Celsius?",
        "23",
    ),
    (
        "calendar",
        'Tool output from calendar.search(query="quarterly review"):\n'
        '{"results": [{"title": "Quarterly review", "date": "2024-05-14", "time": "14:30", '
        '"room": "Orion", "organizer": "Dana Whitfield", "duration_minutes": 90}]}',
        "Which room is the quarterly review in?",
        "Orion",
    ),
    (
        "order",
        'Tool output from orders.get(id=88213):\n{"order_id": 88213, "status": '
        '"shipped", "carrier": "Pelican Express", "tracking": "PX55102938", "items": 3, '
        '"eta": "2024-09-03"}',
        "Which carrier is delivering the order?",
        "Pelican",
    ),
    (
        "stock",
        'Tool output from inventory.lookup(sku="LMP-220"):\n{"sku": "LMP-220", '
        '"name": "desk lamp", "warehouse": "Leeds", "in_stock": 146, "reorder_level": 40}',
        "How many desk lamps are in stock?",
        "146",
    ),
    (
        "user",
        'Tool output from users.find(email="k.osei@example.org"):\n{"name": "Kwame '
        'Osei", "department": "research", "office": "B-217", "manager": "Helen Marsh", '
        '"start_date": "2021-02-01"}',
        "Who is Kwame Osei's manager?",
        "Marsh",
    ),
)
_PROJECTS = (
    (
        "Project Falcon builds the new billing portal. Its manager is Sofia Lindqvist, and "
        "the team meets on Mondays in room Cedar.",
        "Falcon",
        "Lindqvist",
    ),
    (
        "Project Heron migrates the old databases to the cloud. Its manager is Daniel "
        "Okoro, and the team meets on Wednesdays in room Maple.",
        "Heron",
        "Okoro",
    ),
    (
        "Project Kestrel redesigns the mobile app. Its manager is Yuki Tanaka, and the team "
        "meets on Fridays in room Birch.",
        "Kestrel",
        "Tanaka",
    ),
)
_AFTER = (
    (
        "clinic",
        "Clinic notice. Dr. Amelia Hartley will see patients on Thursday "
        "afternoons from next week, in room 3 on the first floor.",
        "Which doctor sees patients on Thursday afternoons?",
        "Hartley",
    ),
    (
        "ferry",
        "Timetable change. From 1 June the first ferry to Skerry Island leaves at "
        "06:20 instead of 06:50, and the last one returns at 21:10.",
        "At what time does the first ferry leave from 1 June?",
        "06:20",
    ),
    (
        "prize",
        "Press release. The Golden Quill prize for short fiction was awarded to "
        "Marisol Quintero for her story about a lighthouse keeper.",
        "Who was awarded the Golden Quill prize?",
        "Quintero",
    ),
    (
        "wifi",
        "Hotel information. The wifi password for guests is SEAGULL42, and breakfast "
        "is served in the garden room until half past ten.",
        "What is the wifi password?",
        "SEAGULL42",
    ),
    (
        "vet",
        "Pet record. Our dog Biscuit is a four-year-old beagle. His vet is Dr. Nils "
        "Ekberg at the Riverside practice, and his next vaccination is due in October.",
        "Who is Biscuit's vet?",
        "Ekberg",
    ),
)
_CHAT = (
    (
        "pip",
        ("system",),
        (
            "You are Pip, the friendly helpdesk assistant of Larkspur "
            "Public Library. Always introduce yourself as Pip. The library is open from nine "
            "until eight on weekdays.",
        ),
        "Hello! What is your name?",
        "Pip",
    ),
    (
        "nordwind",
        ("system",),
        (
            "You are the support agent of Nordwind Bikes in Hamburg. "
            "The shop opens at 10 am and closes at 7 pm from Monday to Saturday. City bikes "
            "cost 15 euros per day.",
        ),
        "What time does the shop open?",
        "10",
    ),
    (
        "exchange",
        ("user", "assistant"),
        (
            "My locker number at the gym is 318, please remember it for me.",
            "Of course. I will remember that your locker number is 318.",
        ),
        "What is my locker number?",
        "318",
    ),
    (
        "travel",
        ("user", "assistant"),
        (
            "I am flying to Reykjavik next Tuesday with my sister Greta.",
            "That sounds exciting! Reykjavik is lovely in spring. Have a great trip with Greta.",
        ),
        "Who am I travelling with?",
        "Greta",
    ),
    (
        "chef",
        ("system", "user", "assistant"),
        (
            "You are a cooking assistant.",
            "Our restaurant's head chef is Marco Pellegrini and he hates cilantro.",
            "Noted: the head chef is Marco Pellegrini, and cilantro stays off the menu.",
        ),
        "Who is the head chef of the restaurant?",
        "Pellegrini",
    ),
)


def _half(kind_index: int, i: int) -> Half:
    return "tune" if (kind_index + i) % 2 == 0 else "report"


def _build() -> tuple[EvalPrompt, ...]:
    out: list[EvalPrompt] = []
    simple = (
        ("facts", _FACTS),
        ("numbers", _NUMBERS),
        ("similar", _SIMILAR),
        ("long", _LONG),
        ("language", _LANGUAGE),
        ("json", _JSON + JSON_MORE),
    )
    k = 0
    for kind_index, (kind, rows) in enumerate(simple):
        for i, (name, chunk, question, expected) in enumerate(rows):
            context = CONTEXTS[k % len(CONTEXTS)]
            k += 1
            out.append(
                EvalPrompt(
                    f"{kind}_{name}",
                    kind,
                    _half(kind_index, i),
                    context,
                    (chunk,),
                    question,
                    expected,
                )
            )
    # Three look-alike projects reused in a new order; the question is about one of them.
    orders = ((2, 0, 1), (1, 2, 0), (0, 2, 1), (2, 1, 0), (1, 0, 2))
    asked = (0, 1, 2, 1, 0)
    for i, (order, target) in enumerate(zip(orders, asked, strict=True)):
        docs = tuple(_PROJECTS[j][0] for j in order)
        # Cached together after a system message in the original order (even i), or each
        # on its own (odd i).
        out.append(
            EvalPrompt(
                f"reorder_{i}",
                "reorder",
                _half(6, i),
                CONTEXTS[(k + i) % len(CONTEXTS)],
                docs,
                f"Who is the manager of Project {_PROJECTS[target][1]}?",
                _PROJECTS[target][2],
                cached_after="Here are the project summaries." if i % 2 == 0 else "",
                cached_order=tuple(order.index(j) for j in range(3)) if i % 2 == 0 else (),
            )
        )
    for i, (name, chunk, question, expected) in enumerate(_AFTER + AFTER_MORE):
        other = CONTEXTS[(i + 2) % len(CONTEXTS)]
        out.append(
            EvalPrompt(
                f"after_{name}",
                "after_context",
                _half(7, i),
                CONTEXTS[i % len(CONTEXTS)],
                (chunk,),
                question,
                expected,
                cached_after=other,
                cached_order=(0,),
            )
        )
    for i, (name, roles, texts, question, expected) in enumerate(_CHAT):
        out.append(
            EvalPrompt(
                f"chat_{name}",
                "chat",
                _half(8, i),
                CONTEXTS[(i + 1) % len(CONTEXTS)],
                texts,
                question,
                expected,
                chat=True,
                roles=roles,
            )
        )
    for i, (name, one, two, question, (fact_one, fact_two)) in enumerate(MULTI_DOC):
        together = i % 2 == 0  # cached inside an earlier request, in the other order
        out.append(
            EvalPrompt(
                f"multi_{name}",
                "multi_doc",
                _half(9, i),
                CONTEXTS[(i + 3) % len(CONTEXTS)],
                (one, two),
                question,
                fact_one,
                cached_after=CONTEXTS[(i + 1) % len(CONTEXTS)] if together else "",
                cached_order=(1, 0) if together else (),
                also=(fact_two,),
            )
        )
    return tuple(out)


PROMPTS: tuple[EvalPrompt, ...] = _build()
KINDS: tuple[str, ...] = tuple(dict.fromkeys(p.kind for p in PROMPTS))


def half(name: Half) -> tuple[EvalPrompt, ...]:
    """The prompts of one half."""
    return tuple(p for p in PROMPTS if p.half == name)
