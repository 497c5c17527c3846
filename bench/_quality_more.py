"""More prompts for bench/_quality_set.py: questions that need two documents, more chunks
cached inside other requests, and more tool results.

``multi_doc``: two short documents, each holding one half of the answer; the question asks
for both halves (the answer must hold both strings). Odd prompts cache the two documents
each on its own; even ones cache them together inside an earlier request, after other
text and in the other order, so the chunk the question needs second was computed first.
"""

from __future__ import annotations

# (name, document one, document two, question, (fact of one, fact of two))
MULTI_DOC: tuple[tuple[str, str, str, str, tuple[str, str]], ...] = (
    (
        "orca",
        "Team directory. The Orca team builds the payment gateway. It is led by Hannah "
        "Brookfield, who joined the company in 2016.",
        "Office list. The Orca team works from the Lisbon office, on the third floor next to "
        "the design studio.",
        "Who leads the Orca team, and in which city does the team work?",
        ("Brookfield", "Lisbon"),
    ),
    (
        "festival",
        "Festival programme. The opening concert on Friday is played by the Halden String Quartet.",
        "Venue notes. The opening concert takes place in the Marble Hall of the old town library.",
        "Who plays the opening concert, and in which hall?",
        ("Halden", "Marble"),
    ),
    (
        "shipment",
        "Order note. The shipment of solar panels is carried by the freight company Tidewell "
        "Logistics.",
        "Port notice. The solar panels arrive at the port of Gdansk on the ninth of May.",
        "Which company carries the solar panels, and to which port?",
        ("Tidewell", "Gdansk"),
    ),
    (
        "novel",
        "Book review. The novel The Salt Orchard was written by Ingrid Vasquez and tells the "
        "story of a family of fruit farmers.",
        "Publisher news. The Salt Orchard is published by Kettle Press, a small publisher in "
        "Bristol.",
        "Who wrote The Salt Orchard, and which publisher published it?",
        ("Vasquez", "Kettle"),
    ),
    (
        "lab",
        "Lab roster. The microscope lab is run by Dr. Felix Amundsen, who trains every new "
        "student.",
        "Building guide. The microscope lab is in room 4.12 of the Pasteur building.",
        "Who runs the microscope lab, and in which room is it?",
        ("Amundsen", "4.12"),
    ),
    (
        "match",
        "Sports page. The cup final was won by the Riverside Otters, who scored in the last "
        "minute.",
        "Stadium news. The cup final was played at Hollins Park in front of twelve thousand fans.",
        "Which team won the cup final, and where was it played?",
        ("Otters", "Hollins"),
    ),
    (
        "course",
        "Course list. The evening pottery course is taught by Mirela Costa, a ceramic artist.",
        "Timetable. The evening pottery course meets every Tuesday at half past six.",
        "Who teaches the evening pottery course, and on which day does it meet?",
        ("Costa", "Tuesday"),
    ),
    (
        "server",
        "Inventory. The database server is named granite-7 and has 256 gigabytes of memory.",
        "Rack map. The server granite-7 is mounted in rack 14 of the Frankfurt data centre.",
        "What is the database server called, and in which city is its data centre?",
        ("granite-7", "Frankfurt"),
    ),
    (
        "garden",
        "Garden club. The rose garden was planted by the head gardener Oskar Lindgren.",
        "Visitor guide. The rose garden is open to visitors from June until September.",
        "Who planted the rose garden, and in which month does it open to visitors?",
        ("Lindgren", "June"),
    ),
    (
        "bakery",
        "Shop guide. The bakery on the corner is owned by Paolo Ferri, who bakes sourdough.",
        "Opening hours. The bakery on the corner opens at six in the morning and closes at two.",
        "Who owns the bakery on the corner, and at what time does it open?",
        ("Ferri", "six"),
    ),
)

# (name, chunk, question, expected): cached inside an earlier request, after other text.
AFTER_MORE: tuple[tuple[str, str, str, str], ...] = (
    (
        "locker",
        "Gym notice. The spare key for the staff lockers is kept by the caretaker, Rufus "
        "Pemberton, in the office by the pool.",
        "Who keeps the spare key for the staff lockers?",
        "Pemberton",
    ),
    (
        "bus",
        "Transport update. Bus route 47 now stops at Elmwood Station instead of the market "
        "square, starting next Monday.",
        "Where does bus route 47 now stop?",
        "Elmwood",
    ),
    (
        "choir",
        "Choir newsletter. Our new conductor is Beatrix Holloway, and rehearsals move to the "
        "church hall on Wednesdays.",
        "Who is the new conductor of the choir?",
        "Holloway",
    ),
    (
        "code",
        "Building access. The door code for the bicycle storage room is 7391, and it is "
        "changed every three months.",
        "What is the door code for the bicycle storage room?",
        "7391",
    ),
)

# (name, tool output, question, expected)
JSON_MORE: tuple[tuple[str, str, str, str], ...] = (
    (
        "flight",
        'Tool output from flights.status(number="NW482"):\n{"flight": "NW482", "status": '
        '"delayed", "gate": "B17", "new_departure": "18:45", "aircraft": "A320"}',
        "From which gate does flight NW482 leave?",
        "B17",
    ),
    (
        "ticket",
        'Tool output from helpdesk.get(ticket=5120):\n{"ticket": 5120, "subject": "printer '
        'jam", "assignee": "Lorenzo Bianchi", "priority": "high", "opened": "2024-03-02"}',
        "Who is the helpdesk ticket assigned to?",
        "Bianchi",
    ),
)
