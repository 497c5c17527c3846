"""Blend mode in real vLLM engines: reuse at another position, inside vLLM's own forward.

One scenario, in order, fp32, one real nopecache server (engines start once, ~30 s each):

  1. engine ALL (blend, every reused token recomputed, no prefix caching) answers a
     report placed before the assistant's system prompt while the server is empty:
     nothing is claimed, the answer and its logprobs are vLLM's own (the baseline).
  2. engine A (blend, the default policy, vLLM's prefix caching on) answers a chat with
     the system prompt at position 0 and stores it.
  3. ALL answers the report prompt again: the connector claims everything up to the
     system prompt's end (the report as misses, the system prompt position-independent),
     the layer loop recomputes every token, and the logprobs equal the baseline's
     within fp32 rounding (the loop is vLLM's arithmetic). The reused rows landed through
     the fused kernel API (calls logged in ALL's worker by tests/support/kernel_probe),
     as nope K rotated to their new positions.
  4. A answers the report prompt with its default policy: the same claim, the system
     prompt's tokens reused position-independently (a share recomputed), an answer.
  5. vLLM's prefix cache and blending together: A's next report prompt gets no local
     prefix-cache hit on the blended blocks (they hold KV vLLM did not compute), while a
     chat sharing the stored system prompt still hits the exact blocks locally.
  6. after an exact prefix: A prefilled the report alone (exact blocks, stored, before
     step 4); ALL loads them and blends the rest, logprobs still vLLM's own; A finds the
     exact blocks in its own prefix cache and blends after them (both at once).
  7. a chat's next turn: what A's blend computed (misses before the reused system
     prompt, the question after it) was stored under content keys, so the next turn's
     claim finds every token of it through the server.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from nopecache.proto import cache_pb2, cache_pb2_grpc
from tests.support.blend_checks import gate_verdict, wait_for_checks
from tests.support.connector_prompts import BLOCK, IM_START, PIP_FACTS
from tests.support.engine_proc import EngineFactory
from tests.support.kernel_probe import KernelProbe
from tests.support.redis_procs import free_ports
from tests.support.server_procs import CacheServerProc, wait_stored

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # hang guards: engine starts

LAYERS = 30
SYSTEM = PIP_FACTS * 2
REPORT = " ".join(
    f"Incident {i}: on line {i % 7 + 1} the {['morning', 'noon', 'evening'][i % 3]} train "
    f"from {['Bodo', 'Narvik', 'Alta', 'Harstad'][i % 4]} ran {5 + 3 * i} minutes late "
    f"because of {['snow', 'a signal fault', 'a crew change', 'track works'][i % 4]}."
    for i in range(24)
)
# Long enough that the stored chat's whole blocks cover the system prompt.
QUESTION = (
    "I am travelling next week with my partner, our two children, our dog and two bikes, "
    "first on the morning train and back late in the evening: what will the trip cost us "
    "and what should we watch out for?"
)
LOGPROB_TOL = 2e-4  # fp32 rounding over 30 layers (measured 3e-5); a wrong row costs > 0.1


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    # fp32 KV of SmolLM2 is 45 KiB a token, stored exact and as chunks: the scenario
    # stores ~2500 tokens' worth. The default 64 MiB tier evicted the system prompt's
    # chunks before the last test whenever no engine had stored them again.
    proc = CacheServerProc(
        Path(tmp_path_factory.mktemp("server")),
        free_ports(1)[0],
        tiers=("cpu://?capacity=512MiB&pinned=no",),
    )
    proc.start()
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> KernelProbe:
    """Logs the placement kernel's calls in the engines started with its env."""
    return KernelProbe(tmp_path_factory.mktemp("probe") / "kernel.log")


@pytest.fixture(scope="module")
def state() -> dict[str, Any]:
    """What the ordered tests hand each other."""
    return {}


def _connector(server: CacheServerProc, **extra: Any) -> dict[str, Any]:
    return {
        "url": f"nopecache://{server.address}",
        "pi_reuse": "blend",
        "segment_token_ids": [IM_START],
        **extra,
    }


def _metrics(engine: Any) -> dict[str, float]:
    return {k.removeprefix("vllm:nopecache_"): v for k, v in engine.metrics().items()}


def _delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def _report_prompt(engine: Any, question: str) -> list[int]:
    return list(
        engine.chat(
            [
                {"role": "user", "content": f"Here is this week's delay report. {REPORT}"},
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": question},
            ]
        )
    )


def _system_span(prompt: list[int]) -> tuple[int, int]:
    """Positions of the system prompt's message (the third message of a report prompt)."""
    starts = [i for i, t in enumerate(prompt) if t == IM_START]
    return starts[2], starts[3]


def _entries(server: CacheServerProc) -> int:
    """How many entries the server holds."""
    with grpc.insecure_channel(server.address) as channel:
        reply = cache_pb2_grpc.KVCacheStub(channel).Stats(cache_pb2.StatsRequest(), timeout=30)
    return sum(t.entries for t in reply.tiers)


def _wait_stored(engine: Any, server: CacheServerProc, tokens: int, entries: int) -> None:
    """Wait until ``engine`` handed ``tokens`` prompt tokens to its store queue and the
    server holds at least ``entries`` entries, their count settled (the client's queue
    sends in the background). Events, not durations: 120 s only bounds a hang on a
    loaded machine (a store lands in well under a second on an idle one)."""
    deadline = time.monotonic() + 120
    while _metrics(engine).get("saved_tokens", 0.0) < tokens:
        assert time.monotonic() < deadline, "the store was never queued"
        time.sleep(0.2)
    wait_stored(server.address, at_least=entries)


def _run(engine: Any, prompt: list[int]) -> dict[str, Any]:
    return engine.generate_many([prompt], max_tokens=8, logprobs=5)[0]


def test_uncached_report_is_the_baseline(
    engines: EngineFactory, server: CacheServerProc, probe: KernelProbe, state: dict[str, Any]
) -> None:
    every = engines(
        dtype="float32",
        connector=_connector(
            server,
            recompute_policy="first_k",
            recompute_budget=1.0,
            save=False,
            blend_check_share=1.0,
        ),
        env=probe.env(),
    )
    prompt = _report_prompt(every, "Which fact of yours helps a passenger of line 3 most?")
    sys_start, sys_end = _system_span(prompt)
    assert sys_start > 600 and sys_end - sys_start > 2 * BLOCK
    base = _run(every, prompt)
    assert base["cached"] == 0 and base["ids"]
    state.update(every=every, prompt=prompt, base=base, span=(sys_start, sys_end), probe=probe)


def test_chat_with_system_prompt_first_is_stored(
    engines: EngineFactory, server: CacheServerProc, state: dict[str, Any]
) -> None:
    a = engines(
        dtype="float32",
        prefix_caching=True,
        # Every hit kept: the client's cost model learns fetch times on this machine (its
        # load included) and may drop hits; the claims asserted here must not vary.
        connector=_connector(
            server, url=f"nopecache://{server.address}?cost_enabled=false", blend_check_share=0.0
        ),
    )
    # SmolLM2 passes the correctness gate at the default policy and budget (gate.py).
    verdict = gate_verdict(a.log_path)
    assert verdict.passed and verdict.policy == "first_k(0.15)", verdict.line
    chat = list(
        a.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    )
    system_end = [i for i, t in enumerate(chat) if t == IM_START][1]
    assert len(chat) // BLOCK * BLOCK >= system_end  # whole blocks hold the system prompt
    entries = _entries(server)
    out = a.generate(chat, max_tokens=4)
    assert out["cached"] == 0
    # Each whole block is one exact entry at least (chunks come on top).
    _wait_stored(a, server, len(chat) // BLOCK * BLOCK, entries + len(chat) // BLOCK)
    state.update(a=a, chat=chat, server=server)


def test_all_recompute_blend_equals_vllms_own_logits(state: dict[str, Any]) -> None:
    every, prompt, base = state["every"], state["prompt"], state["base"]
    sys_start, sys_end = state["span"]
    before = _metrics(every)
    out = _run(every, prompt)
    after = _metrics(every)
    claim = sys_end - sys_end % BLOCK
    assert out["cached"] == claim
    assert _delta(after, before, "blend_claimed_tokens") == claim
    reused = _delta(after, before, "loaded_pi_tokens")
    assert reused == claim - sys_start  # the system prompt's tokens inside the claim
    assert _delta(after, before, "blend_miss_tokens") == sys_start
    assert _delta(after, before, "pi_token_layers") == reused * LAYERS
    assert _delta(after, before, "recomputed_token_layers") == reused * LAYERS
    assert _delta(after, before, "blend_fallbacks") == 0
    # The reused rows, and nothing else, landed through the kernel API: nope K rotated.
    placed = state["probe"].take()
    assert placed["nope"] == reused and placed["same"] == placed["moved"] == 0
    assert out["ids"] == base["ids"]
    worst = 0.0
    for mine, ref in zip(out["logprobs"], base["logprobs"], strict=True):
        assert mine.keys() == ref.keys()
        worst = max(worst, *(abs(mine[t] - ref[t]) for t in ref))
    print(f"all-recompute blend vs vLLM: largest logprob difference {worst:.2e}")
    assert worst <= LOGPROB_TOL, f"logprobs differ by {worst}"


def test_sampled_check_of_an_all_recompute_blend_finds_no_divergence(
    state: dict[str, Any],
) -> None:
    # ALL checks every blended request (blend_check_share 1) in the background: its
    # blend is vLLM's arithmetic, so the plain-torch full prefill agrees with it.
    checks = wait_for_checks(state["every"], 1)
    assert checks.count == 1
    assert 0.0 <= checks.kl_mean < 1e-3  # fp32 rounding; a wrong row costs > 0.1
    assert checks.top1_mean == 1.0


def test_report_alone_is_stored_exact(state: dict[str, Any]) -> None:
    # A prefills the report with another ending itself (nothing to blend: vLLM computes
    # it, its blocks are exact): they land in A's prefix cache and on the server. Before
    # A blends the report prompt: that blend stores the report's chunks under content
    # keys (they were computed inside the claim), and a report asked after it would be
    # a blend claim itself.
    a, prompt = state["a"], state["prompt"]
    sys_start, _ = state["span"]
    report_only = list(
        a.chat(
            [
                {"role": "user", "content": f"Here is this week's delay report. {REPORT}"},
                {"role": "user", "content": "Summarise it."},
            ]
        )
    )
    # Without the generation prompt: its three tokens are a stored chunk (every stored
    # chat ends with one), and a hit at the prompt's end would make the report a blend
    # claim of misses before the loop's rate is measured (the cost model then says no).
    report_only = report_only[: max(i for i, t in enumerate(report_only) if t == IM_START)]
    exact = min(sys_start, len(report_only)) // BLOCK * BLOCK
    assert prompt[:exact] == report_only[:exact] and exact >= 4 * BLOCK
    saved = _metrics(a).get("saved_tokens", 0.0)
    entries = _entries(state["server"])
    out = a.generate(report_only, max_tokens=2)
    assert out["cached"] == 0
    _wait_stored(a, state["server"], int(saved) + exact, entries + exact // BLOCK)
    state.update(exact=exact)


def test_report_before_system_prompt_reuses_it(state: dict[str, Any]) -> None:
    a, prompt, exact = state["a"], state["prompt"], state["exact"]
    sys_start, sys_end = state["span"]
    before = _metrics(a)
    out = a.generate(prompt, max_tokens=24)
    after = _metrics(a)
    claim = sys_end - sys_end % BLOCK
    assert out["cached"] == claim
    # The report's exact blocks from A's own prefix cache; the claim starts after them.
    assert _delta(after, before, "vllm:prefix_cache_hits") == exact
    assert _delta(after, before, "blend_claimed_tokens") == claim - exact
    # The system prompt, and the report's last chunk too (the report alone stored it).
    reused = _delta(after, before, "loaded_pi_tokens")
    assert reused >= claim - sys_start
    assert _delta(after, before, "blend_miss_tokens") == claim - exact - reused
    assert _delta(after, before, "claimed_pi_tokens") == reused
    layers = _delta(after, before, "pi_token_layers")
    assert layers == reused * LAYERS
    share = _delta(after, before, "recomputed_token_layers") / layers
    assert 0.10 <= share <= 0.20  # the default policy: 15% of the reused token-layers
    assert out["ids"], "no answer"


def test_prefix_cache_never_serves_blended_blocks(state: dict[str, Any]) -> None:
    a, chat = state["a"], state["chat"]
    before = a.metrics()
    again = _report_prompt(a, "Which line was the latest?")
    out = a.generate(again, max_tokens=4)
    after = a.metrics()
    # vLLM's prefix cache is asked before the connector: the blocks of the blended
    # prompt are not exact, so none is served (unsalted, the shared 896 tokens would be),
    # only the report alone's exact blocks before them.
    assert _delta(after, before, "vllm:prefix_cache_hits") == state["exact"]
    assert out["ids"]
    same_system = list(
        a.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Bikes?"}])
    )
    before = a.metrics()
    a.generate(same_system, max_tokens=4)
    after = a.metrics()
    shared = min(len(chat), len(same_system)) // BLOCK * BLOCK
    assert _delta(after, before, "vllm:prefix_cache_hits") >= shared - BLOCK


def test_blend_after_an_exact_prefix_local_or_loaded(state: dict[str, Any]) -> None:
    a, every, prompt, base = state["a"], state["every"], state["prompt"], state["base"]
    sys_start, sys_end = state["span"]
    exact = state["exact"]  # the report alone's exact blocks, on the server and in A
    claim = sys_end - sys_end % BLOCK

    # ALL loads the exact blocks, blends the rest: still vLLM's own logprobs.
    before = _metrics(every)
    out = _run(every, prompt)
    after = _metrics(every)
    assert out["cached"] == claim
    assert _delta(after, before, "loaded_exact_tokens") == exact
    assert _delta(after, before, "blend_claimed_tokens") == claim
    # The system prompt, and the report's last chunk too (report_only stored it), reused.
    reused = _delta(after, before, "loaded_pi_tokens")
    assert reused >= claim - sys_start
    assert _delta(after, before, "blend_miss_tokens") == claim - exact - reused
    # Exact blocks copied at their positions, reused chunks rotated: all through the kernel.
    placed = state["probe"].take()
    assert (placed["same"], placed["nope"], placed["moved"]) == (exact, reused, 0)
    assert out["ids"] == base["ids"]
    worst = max(
        abs(mine[t] - ref[t])
        for mine, ref in zip(out["logprobs"], base["logprobs"], strict=True)
        for t in ref
    )
    assert worst <= LOGPROB_TOL, f"logprobs differ by {worst}"

    # A holds the exact blocks in its own prefix cache, and vLLM asks the connector only
    # past them: the blend claim starts there and reaches the system prompt's end. Its
    # ~20 misses and 15% of ~240 reused tokens in the loop against vLLM's prefill of 256:
    # the cost model takes it by a wide margin.
    before_all = _metrics(a)
    out = a.generate(prompt, max_tokens=8)
    after_all = _metrics(a)
    assert _delta(after_all, before_all, "vllm:prefix_cache_hits") == exact
    assert out["cached"] == claim
    assert _delta(after_all, before_all, "blend_claimed_tokens") == claim - exact
    assert _delta(after_all, before_all, "loaded_exact_tokens") == 0
    assert out["ids"]


LOG = " ".join(
    f"Log {i}: the {['ferry', 'night bus', 'tram', 'cable car'][i % 4]} at "
    f"{['Tromso', 'Bergen', 'Molde', 'Lofoten'][i % 4]} was serviced on day {3 + 2 * i}, "
    f"{['brakes checked', 'doors fixed', 'heating replaced', 'seats cleaned'][i % 4]}."
    for i in range(2)  # few misses before the reused system prompt: the claim pays
)
# Turn 1's question: new text (no chunk of it stored yet), sentences to cut it at.
TRIP = [
    f"On day {d} of my trip I want the {['ferry', 'night train', 'bus', 'tram'][d % 4]} "
    f"from {['Alta', 'Bodo', 'Narvik', 'Harstad', 'Molde'][d % 5]} at {5 + d}:15 with "
    f"{['a pram', 'two cases', 'a bike', 'my cat', 'skis'][d % 5]}: is that allowed?"
    for d in range(30)
]


def _turn(a: Any, question: str, *more: dict[str, str]) -> list[int]:
    return list(
        a.chat(
            [
                {"role": "user", "content": f"Here is the maintenance log. {LOG}"},
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": question},
                *more,
            ]
        )
    )


def test_next_turn_reuses_what_the_blend_computed(state: dict[str, Any]) -> None:
    """Issue 33: a blend claim keeps what it computes. Turn 1 reuses the system prompt
    position-independently; the log before it (misses, computed by the layer loop) and
    the question after it (computed by vLLM past the claim) attended to approximate KV,
    so they are stored under content keys only. Turn 2 (the same chat plus a short answer
    and a short question) finds all of them through the server: no miss in its claim."""
    a, server = state["a"], state["server"]
    # Turn 1's question spans over a block and ends well inside one, so turn 2's claim
    # (cut at a block, before the prompt's last token) ends inside that question whether
    # or not the short tail after it has hits: every claimed token is a known one.
    for sentences in range(8, len(TRIP)):
        question = " ".join(TRIP[:sentences])
        turn1 = _turn(a, question)
        asked = [i for i, t in enumerate(turn1) if t == IM_START][3]
        if len(turn1) - asked > 2 * BLOCK and 48 <= len(turn1) % BLOCK <= BLOCK - 32:
            break
    else:
        pytest.fail("no question length ends inside a block")
    before = _metrics(a)
    entries = _entries(server)
    first = a.generate(turn1, max_tokens=4)
    after = _metrics(a)
    assert _delta(after, before, "blend_miss_tokens") > 0  # the log: new content
    assert _delta(after, before, "loaded_pi_tokens") > 0  # the system prompt
    _wait_stored(a, server, int(before.get("saved_tokens", 0.0)) + len(turn1), entries + 1)

    answer = {"role": "assistant", "content": first["text"]}
    turn2 = _turn(a, question, answer, {"role": "user", "content": "Sundays?"})
    assert turn2[: len(turn1) - 3] == turn1[: len(turn1) - 3]  # up to the generation prompt
    claim = (len(turn2) - 1) // BLOCK * BLOCK
    assert claim == (len(turn1) - 3) // BLOCK * BLOCK > asked + BLOCK
    before = _metrics(a)
    out = a.generate(turn2, max_tokens=4)
    after = _metrics(a)
    local = _delta(after, before, "vllm:prefix_cache_hits")
    assert out["cached"] == claim
    assert _delta(after, before, "blend_claimed_tokens") == claim - local
    # Every claimed token was found: the log and turn 1's question as content blocks.
    assert _delta(after, before, "blend_miss_tokens") == 0
    assert _delta(after, before, "loaded_pi_tokens") == claim - local
    assert out["ids"]


def test_share_zero_checks_nothing(state: dict[str, Any]) -> None:
    # A (blend_check_share 0) blended three requests above and ran its steps since:
    # no check was sampled, no histogram observed.
    metrics = state["a"].metrics()
    assert metrics.get("vllm:nopecache_blend_kl:count", 0.0) == 0.0
    assert metrics.get("vllm:nopecache_blend_top1:count", 0.0) == 0.0
    assert metrics.get("vllm:nopecache_blend_checks", 0.0) == 0.0
