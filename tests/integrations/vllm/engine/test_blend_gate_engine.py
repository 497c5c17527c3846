"""The blend correctness gate refuses a mis-described RoPE in a real vLLM engine.

The connector's ``rope_override`` replaces the model config's RoPE parameters in the
connector's description (the rotation every store and fetch applies); vLLM itself still
runs SmolLM2's own RoPE (base 100000, no scaling). At start-up the worker's gate rotates
the model's pre-RoPE K with the description and compares it with vLLM's rotary
embedding, and blends the calibration prompts (``integrations/vllm/gate.py``):

  1. a base 10x too small: refused (RoPE error and answers both say so); the engine
     then runs prefix mode only: a report placed before a system prompt that another
     engine stored, which a blending engine claims up to the system prompt's end
     (test_blend_engine), claims nothing, counts a ``blend_fallbacks``, and answers
     exactly as before anything was stored (the same ids and logprobs).
  2. a linear scaling of 2 the model does not use: refused on the RoPE error alone (its
     answers on the short calibration prompts would pass).
  3. SmolLM2 in bf16 with its own description: passes.

SmolLM2 with its own description passes: in fp32 (test_blend_engine's engine A) and in
bf16, whose rounding of vLLM's own rotation the RoPE check allows (3).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from nopecache.proto import cache_pb2, cache_pb2_grpc
from tests.support.blend_checks import gate_verdict
from tests.support.connector_prompts import BLOCK, IM_START, PIP_FACTS
from tests.support.engine_proc import EngineFactory
from tests.support.redis_procs import free_ports
from tests.support.server_procs import CacheServerProc, wait_stored

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # hang guards: engine starts

SYSTEM = PIP_FACTS * 2
REPORT = " ".join(
    f"Incident {i}: on line {i % 5 + 1} the {['early', 'late'][i % 2]} bus from "
    f"{['Tromso', 'Bergen', 'Molde'][i % 3]} ran {4 + 2 * i} minutes late."
    for i in range(30)
)
WRONG_BASE = {"rope_type": "default", "rope_theta": 10000.0}  # SmolLM2's is 100000
WRONG_SCALING = {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    proc = CacheServerProc(
        Path(tmp_path_factory.mktemp("server")),
        free_ports(1)[0],
        tiers=("cpu://?capacity=256MiB&pinned=no",),
    )
    proc.start()
    yield proc
    proc.kill()


def _connector(server: CacheServerProc, rope: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "url": f"nopecache://{server.address}",
        "pi_reuse": "blend",
        "segment_token_ids": [IM_START],
        "rope_override": rope,
        **extra,
    }


def _entries(server: CacheServerProc) -> int:
    with grpc.insecure_channel(server.address) as channel:
        reply = cache_pb2_grpc.KVCacheStub(channel).Stats(cache_pb2.StatsRequest(), timeout=30)
    return sum(t.entries for t in reply.tiers)


def _metrics(engine: Any) -> dict[str, float]:
    return {k.removeprefix("vllm:nopecache_"): v for k, v in engine.metrics().items()}


def test_wrong_rope_base_is_refused_and_the_engine_answers_as_prefix_mode(
    engines: EngineFactory, server: CacheServerProc
) -> None:
    # save off: the report prompt's own blocks never become an exact prefix for its
    # second run, which must run exactly as its first.
    engine = engines(dtype="float32", connector=_connector(server, WRONG_BASE, save=False))
    verdict = gate_verdict(engine.log_path)
    print(f"wrong base: {verdict.line}")
    assert not verdict.passed
    assert verdict.rope_error > 0.1  # a right description is at fp32 rounding (~1e-7)
    assert verdict.policy == "first_k(0.15)" and verdict.prompts == 3
    log = engine.log_path.read_text(errors="replace")
    assert "blend mode refused by a worker, prefix mode only" in log  # the scheduler half

    report = list(
        engine.chat(
            [
                {"role": "user", "content": f"Here is this week's delay report. {REPORT}"},
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Which fact of yours helps a bus passenger?"},
            ]
        )
    )
    base = engine.generate_many([report], max_tokens=8, logprobs=5)[0]
    assert base["cached"] == 0

    # A prefix-mode engine with the same description (the same keys) stores a chat with
    # the system prompt first: its chunks are then position-independent hits of the report.
    storer = engines(
        dtype="float32",
        connector={
            "url": f"nopecache://{server.address}",
            "segment_token_ids": [IM_START],
            "rope_override": WRONG_BASE,
        },
    )
    chat = list(
        storer.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi?"}])
    )
    system_end = [i for i, t in enumerate(chat) if t == IM_START][1]
    assert system_end > 2 * BLOCK
    entries = _entries(server)
    storer.generate(chat, max_tokens=2)
    # Each whole block is one exact entry at least (the chunks come on top): wait for
    # the store queue to land them, an event (seconds on an idle machine).
    wait_stored(server.address, at_least=entries + len(chat) // BLOCK)
    storer.stop()

    before = _metrics(engine)
    out = engine.generate_many([report], max_tokens=8, logprobs=5)[0]
    after = _metrics(engine)
    # A blend engine claims up to the system prompt's end here; this one claims nothing
    # (no exact prefix) and counts the blend claim it did not make.
    assert out["cached"] == 0
    assert after.get("lookups", 0.0) - before.get("lookups", 0.0) == 1
    assert after.get("blend_fallbacks", 0.0) - before.get("blend_fallbacks", 0.0) == 1
    assert after.get("blend_claimed_tokens", 0.0) == 0.0
    assert out["ids"] == base["ids"]
    assert out["logprobs"] == base["logprobs"]
    engine.stop()


def test_wrong_rope_scaling_is_refused_on_the_rope_check(
    engines: EngineFactory, server: CacheServerProc
) -> None:
    engine = engines(dtype="float32", connector=_connector(server, WRONG_SCALING))
    verdict = gate_verdict(engine.log_path)
    print(f"wrong scaling: {verdict.line}")
    assert not verdict.passed
    assert verdict.rope_error > 0.1
    engine.stop()


def test_smollm2_in_bf16_passes_within_its_own_rounding(
    engines: EngineFactory, server: CacheServerProc
) -> None:
    # bf16 rounds vLLM's own rotation (5.5e-03 of the largest |K| against the fp32
    # description): the RoPE check allows 4 bf16 epsilons, a wrong RoPE is at ~1.
    engine = engines(
        dtype="bfloat16",
        connector={"url": f"nopecache://{server.address}", "pi_reuse": "blend"},
    )
    verdict = gate_verdict(engine.log_path)
    print(f"bf16: {verdict.line}")
    assert verdict.passed
    assert 0.0 < verdict.rope_error <= 4 * 2**-7
    engine.stop()
