"""A slow lookup in a real vLLM: the request waits for it, the batch does not.

One engine (bf16, CPU) and a real cache server in this process whose Lookups are held
500 ms each (``tests/support/slow_lookups``). The scenario makes "the batch kept running
while the lookup was in flight" an event, not a timing: engine first stores prompt A;
then A' (A's system prompt, another question) and a short prompt S (shorter than one
vLLM block: never looked up) are submitted together, and A''s lookup is held until the
server holds S's KV. S's KV can only arrive if vLLM prefilled S, and stored it, while
A''s lookup was in flight. A connector whose lookup blocked vLLM's scheduler would hold
every step: S would never run, the lookup would time out and A' would claim nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.connector_prompts import BLOCK, PIP_FACTS
from tests.support.engine_proc import EngineFactory, common_prefix
from tests.support.server_procs import wait_stored
from tests.support.slow_lookups import SlowServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # hang guards: engine starts

SYSTEM = PIP_FACTS * 3


@pytest.fixture(scope="module")
def slow() -> Iterator[SlowServer]:
    server = SlowServer()
    yield server
    server.stop()


def test_a_held_lookup_does_not_hold_other_requests(
    engines: EngineFactory, slow: SlowServer
) -> None:
    # The client's lookup timeout is longer than any hold: a held lookup answers.
    engine = engines(connector={"url": f"nopecache://{slow.address}?lookup_timeout=60s"})

    def chat(question: str, system: str | None = SYSTEM) -> list[int]:
        messages = [{"role": "user", "content": question}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        return list(engine.chat(messages))

    first, again = chat("How much is a day pass?"), chat("When does the night train leave?")
    short = chat("Hi!", system=None)
    assert len(short) <= BLOCK  # no whole block to claim: vLLM never asks the connector
    assert engine.generate(first, max_tokens=2)["cached"] == 0
    stored = wait_stored(slow.address, at_least=len(first) // BLOCK)

    async def short_stored() -> bool:
        return await slow.entries() > stored

    slow.lookups.delay_s = 0.5
    slow.lookups.release = short_stored
    out_again, out_short = engine.generate_many([again, short], max_tokens=2)
    claim = common_prefix(first, again) // BLOCK * BLOCK
    assert claim >= 3 * BLOCK
    # The lookup answered after S was prefilled and stored, in time for A' to claim it.
    assert slow.lookups.gated == 0
    assert out_again["cached"] == claim
    assert out_short["cached"] == 0 and out_short["ids"]
    # S had its first token before A' could have had one (A''s was held until S stored).
    assert out_short["ttft"] < out_again["ttft"]
