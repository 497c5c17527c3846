"""Parity: nopecache never hands an engine KV computed for another input (issue 32).

Every output of an engine reading the cache must be token-identical (fp32, greedy) to a
no-cache engine's output for the same prompt and the same identity (adapter, cache salt,
image), and claims must stop where a correct key stops them. Engines are shared by the
module (each start costs ~30 s of CI); one server serves them all:

  ref     SmolLM2, no connector, LoRA on: the reference for every SmolLM2 request
  e1, e2  SmolLM2 + connector (pi_reuse "off", exact prefixes only), LoRA on: e1 stores,
          e2 serves the same prompts under other identities
  chat    SmolLM2 + connector in pi_reuse "contiguous", vLLM's prefix cache on
  vlm     a tiny SmolVLM-shaped model (tests/support/tiny_vlm.py): a no-cache reference
          and a connector engine

Tests, in order:
  1. mixed identities in flight together (adapters A, B and none; salts s1, s2 and none;
     adapter requests apart from the others, a vLLM CPU limit: tests/support/parity_traffic):
     outputs equal the reference; every claim is exactly the same-identity prefix stored
     (salt s2, never stored, claims nothing).
  2. the same traffic with the server injecting faults into the blocks it sends: outputs
     still equal the reference, the server counted faults and e2 recomputed them.
  3. bench/vllm_parity.py's quick run on these engines (the same three configurations the
     bench starts, so test_bench_quick.py does not start them again): its text traffic
     under the bench's faults has no mismatch, and the RESULT line its code prints has
     exactly its RESULT_KEYS.
  4. a multi-turn chat in contiguous mode (turn 2 extends turn 1, whose moved history was
     claimed position-independently), then an "off" engine asks turn 2: its exact loads stop
     where turn 1's exact prefix ended, its output equals the reference.
  5. two different images of the same size (identical prompt token ids): image 2 never
     gets image 1's KV; image 1 asked again still claims its own blocks.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.support.bench_runs import BENCH, declared_keys, parse_result

if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import vllm_parity as bench

from tests.support.connector_prompts import BLOCK, IM_START, PIP_FACTS
from tests.support.engine_proc import EngineFactory, EngineProc, Identity
from tests.support.fault_servers import FaultServer, fault_args
from tests.support.lora import write_adapter
from tests.support.parity_traffic import (
    Request,
    expected_claim,
    identities,
    run_round,
    serve_round,
    store_round,
)
from tests.support.redis_procs import free_ports
from tests.support.server_procs import CacheServerProc, wait_stored
from tests.support.tiny_vlm import IMAGE_SIZE, write_tiny_vlm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # hang guards: engine starts

QUESTIONS = [
    "How much is a day pass?",
    "Can I take my bike at 8 am?",
    "When does the night train leave?",
    "How long is lost property kept?",
    "What refund do I get for a 90 minute delay?",
    "Where is the quiet carriage?",
]
FAULTS = "seed=7,rate=0.3,kinds=flip,truncate,drop,delay"
MAX_TOKENS = 8
LORA = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}


def _connector(address: str, **extra: Any) -> dict[str, Any]:
    # The lookup bound is only a hang guard: a lookup that times out on a loaded machine
    # would claim nothing and turn an exact claim assertion into noise.
    return {"url": f"nopecache://{address}?lookup_timeout=10s", **extra}


def _metric(engine: EngineProc, name: str) -> float:
    return engine.metrics().get(f"vllm:nopecache_{name}", 0.0)


def _run(engine: EngineProc, requests: list[Request]) -> list[dict[str, Any]]:
    """The requests in flight together (adapter ones apart, see parity_traffic)."""
    return run_round(engine, requests, MAX_TOKENS)


def _mismatches(
    requests: list[Request], outs: list[dict[str, Any]], refs: list[dict[str, Any]]
) -> list[str]:
    return [
        f"{r.label()}: {o['ids']} != reference {ref['ids']} (cached {o['cached']})"
        for r, o, ref in zip(requests, outs, refs, strict=True)
        if o["ids"] != ref["ids"]
    ]


@contextmanager
def _faults_on(server: CacheServerProc, spec: str) -> Iterator[FaultServer]:
    """The module's server restarted on its port (so the engines reconnect; it comes back
    empty) injecting the faults of ``spec``; restarted without faults after, whatever
    happened, since the next tests need it."""
    metrics_port = free_ports(1)[0]
    server.kill()
    server.extra_args = fault_args(spec, metrics_port)
    try:
        server.start()
        yield FaultServer(server, metrics_port)
    finally:
        server.kill()
        server.extra_args = ()
        server.start()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CacheServerProc]:
    """One server for every engine of the module (restarted on its port with faults on)."""
    # 1 GiB: a 128-token fp32 SmolLM2 block is ~5.9 MB; the default 64 MiB tier would evict
    # the first requests' blocks before the second engine asks for them.
    tier = "cpu://?capacity=1GiB&pinned=no"
    proc = CacheServerProc(tmp_path_factory.mktemp("server"), free_ports(1)[0], tiers=(tier,))
    proc.start()
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, model_dir: str) -> tuple[str, str]:
    """Two seeded LoRA adapters (A, B) for SmolLM2."""
    root = tmp_path_factory.mktemp("lora")
    return str(write_adapter(root / "a", 1, model_dir)), str(
        write_adapter(root / "b", 2, model_dir)
    )


@pytest.fixture(scope="module")
def state() -> dict[str, Any]:
    """What the ordered tests hand each other (engines, rounds, reference outputs)."""
    return {}


def test_mixed_identities_match_the_reference(
    engines: EngineFactory,
    server: CacheServerProc,
    adapters: tuple[str, str],
    state: dict[str, Any],
) -> None:
    ref = engines(dtype="float32", extra=LORA)
    e1 = engines(dtype="float32", extra=LORA, connector=_connector(server.address))
    e2 = engines(dtype="float32", extra=LORA, connector=_connector(server.address))
    system = {"role": "system", "content": PIP_FACTS * 3}
    prompts = [ref.chat([system, {"role": "user", "content": q}]) for q in QUESTIONS]
    stored_ids = identities(*adapters)
    stored, served = store_round(prompts, stored_ids), serve_round(prompts, stored_ids)
    refs_stored, refs_served = _run(ref, stored), _run(ref, served)
    state.update(ref=ref, e1=e1, e2=e2, stored=stored, served=served, refs=refs_served)
    # The traffic has teeth: adapters A, B and none answer the same prompt differently.
    teeth = [Request(prompts[0], Identity(lora=a)) for a in (None, *adapters)]
    answers = [tuple(_run(ref, [r])[0]["ids"]) for r in teeth]
    assert len(set(answers)) == 3, answers

    assert _mismatches(stored, _run(e1, stored), refs_stored) == []
    wait_stored(server.address, at_least=1)
    claimed_before = _metric(e2, "claimed_exact_tokens")
    outs = _run(e2, served)
    want = [expected_claim(r, stored) for r in served]
    assert want[-1] == 0 and sum(want) >= 4 * BLOCK  # the salt nobody stored; real shares
    assert _mismatches(served, outs, refs_served) == []
    assert [o["cached"] for o in outs] == want
    assert _metric(e2, "claimed_exact_tokens") - claimed_before == sum(want)


def test_faults_on_the_load_path_are_recomputed(
    server: CacheServerProc, state: dict[str, Any]
) -> None:

    e1, e2, stored, served = state["e1"], state["e2"], state["stored"], state["served"]
    with _faults_on(server, FAULTS) as faulty:
        _run(e1, stored)
        wait_stored(server.address, at_least=1)
        errors_before = _metric(e2, "load_errors")
        outs = _run(e2, served)
        assert _mismatches(served, outs, state["refs"]) == []
        assert faulty.faults_injected() > 0
        assert _metric(e2, "load_errors") > errors_before


def test_the_bench_quick_run_matches_the_reference(
    server: CacheServerProc, adapters: tuple[str, str], state: dict[str, Any]
) -> None:
    # bench/vllm_parity.py --quick starts ref, e1 and e2 as configured here (fp32, LoRA, the
    # same connector URL) and a server injecting its faults, then runs text_traffic: run
    # that on this module's engines instead of three more engine starts.
    procs = {name: state[name] for name in ("ref", "e1", "e2")}
    skipped_before = bench.skipped_requests(list(procs.values()))  # the earlier tests' skips
    with _faults_on(server, bench.FAULTS) as faulty:
        requests, mismatches = bench.text_traffic(procs, server.address, adapters, bench.QUICK)
        faults = faulty.faults_injected()
    skipped = bench.skipped_requests(list(procs.values())) - skipped_before
    line = bench.result_line(requests, mismatches, faults, skipped)
    print(line)
    fields = parse_result(line)
    assert list(fields) == list(declared_keys(BENCH / "vllm_parity.py")), line
    assert int(fields["parity_requests"]) > 0, line
    assert int(fields["mismatches"]) == 0, line
    assert int(fields["faults_injected"]) > 0, line
    state["e1"].stop()  # each engine holds ~2 GiB: keep at most three alive


def _chat_turns() -> list[tuple[str, str]]:
    turns = [
        ("Where does the night train go?", "It goes to Tromso, leaving at 22:40."),
        ("Which platform?", "Platform 3 at the central station."),
        ("Is there a quiet carriage?", "Yes, coach C is always the quiet carriage."),
        ("Can I bring my dog?", "Yes, dogs travel for half the child fare."),
        ("And my bike in the evening?", "Bikes are free outside 4 to 6 pm and 7 to 9 am."),
        ("How long is lost property kept?", "For 30 days at the central station office."),
    ]
    return turns * 2


def test_contiguous_chat_never_becomes_exact(
    engines: EngineFactory, server: CacheServerProc, state: dict[str, Any]
) -> None:
    ref, e2 = state["ref"], state["e2"]
    chat = engines(
        dtype="float32",
        prefix_caching=True,
        connector=_connector(server.address, pi_reuse="contiguous", segment_token_ids=[IM_START]),
    )
    system = {"role": "system", "content": "You are Pip, the assistant of Grey Valley Lines."}

    def messages(pairs: list[tuple[str, str]], question: str) -> list[int]:
        out = [system]
        for user, assistant in pairs:
            out += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        return ref.chat([*out, {"role": "user", "content": question}])

    turns = _chat_turns()
    full = messages(turns, "When do reservations close?")
    chat.generate(full, max_tokens=4)
    wait_stored(server.address, at_least=1)
    # Turn 1: the oldest turns dropped, so the history after the system prompt moved: the
    # engine claims it position-independently (approximate KV) past the exact prefix.
    pi_before = _metric(chat, "claimed_pi_tokens")
    turn1 = messages(turns[4:], "Can I reserve a seat?")
    chat.generate(turn1, max_tokens=MAX_TOKENS)
    exact1 = expected_claim(Request(turn1, Identity()), [Request(full, Identity())])
    assert _metric(chat, "claimed_pi_tokens") > pi_before, "no contiguous claim happened"
    # Turn 2 extends turn 1 on the same engine: vLLM's own prefix cache holds turn 1.
    turn2 = messages(
        [*turns[4:], ("Can I reserve a seat?", "Yes, until 15 minutes before.")], "And a bike?"
    )
    assert turn2[: len(turn1)] == turn1
    chat.generate(turn2, max_tokens=MAX_TOKENS)
    wait_stored(server.address, at_least=1)
    # An exact-only engine asks turn 2: it may load only what was computed exactly.
    loaded_before = _metric(e2, "loaded_exact_tokens")
    out = e2.generate(turn2, max_tokens=MAX_TOKENS)
    want = ref.generate(turn2, max_tokens=MAX_TOKENS)
    assert out["cached"] == exact1
    assert _metric(e2, "loaded_exact_tokens") - loaded_before == exact1
    assert out["ids"] == want["ids"]
    chat.stop()
    e2.stop()
    ref.stop()


def test_images_of_the_same_size_never_share(
    engines: EngineFactory,
    server: CacheServerProc,
    model_dir: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    vlm_dir = str(write_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model", Path(model_dir)))
    config: dict[str, Any] = {"model": vlm_dir, "dtype": "float32", "max_model_len": 1024}
    config["extra"] = {"limit_mm_per_prompt": {"image": 1}}
    ref = engines(**config)
    vlm = engines(**config, connector=_connector(server.address))
    # One block and more of text after the image, so the image's block is a whole block.
    prompt = "<image>" + " Describe the picture in words." * 30
    image = [Identity(image_seed=s, image_size=(IMAGE_SIZE, IMAGE_SIZE)) for s in (1, 2)]
    refs = ref.generate_many([prompt] * 2, max_tokens=12, identities=image)
    assert refs[0]["prompt_ids"] == refs[1]["prompt_ids"]  # identical placeholder ids
    assert refs[0]["ids"] != refs[1]["ids"], "the two images give the same answer"
    first = vlm.generate_many([prompt], max_tokens=12, identities=image[:1])[0]
    assert first["ids"] == refs[0]["ids"]
    wait_stored(server.address, at_least=1)
    second, again = vlm.generate_many([prompt] * 2, max_tokens=12, identities=image[::-1])
    assert second["ids"] == refs[1]["ids"]
    assert second["cached"] == 0
    assert again["ids"] == refs[0]["ids"]
    assert again["cached"] == (len(refs[0]["prompt_ids"]) - 1) // BLOCK * BLOCK
