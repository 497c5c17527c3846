"""A mis-described RoPE is refused in a real vLLM engine, before anything is reused.

The connector's ``rope_override`` replaces the model config's RoPE parameters in the
connector's description (the rotation every store and fetch applies); vLLM itself still
runs SmolLM2's own RoPE (base 100000, no scaling). At start-up every worker that stores
or loads position-independent blocks rotates seeded pre-RoPE K with the description and
compares it with each layer's own rotary embedding at four positions
(``integrations/vllm/rope_check.py``); in blend mode the correctness gate then blends
the calibration prompts (``integrations/vllm/gate.py``):

  1. a base 10x too small: the RoPE check refuses it (every figure logged, counted as
     ``rope_check_failed``) and the scheduler half, told through the start-up
     handshake, looks up exact prefixes only; the gate never runs (there is nothing to
     blend). A prefix-mode engine with the same description stores exact prefix keys
     only. A report placed before a system prompt that engine stored, which a blending
     engine claims up to the system prompt's end (test_blend_engine), claims nothing and
     answers exactly as before anything was stored (the same ids and logprobs).
  2. a linear scaling of 2 the model does not use: refused by the RoPE check too (its
     answers on the short calibration prompts would pass the gate).
  3. SmolLM2 in bf16 with its own description: both pass, within bf16's rounding.

SmolLM2 with its own description passes: in fp32 (test_blend_engine's engine A) and in
bf16, whose rounding of vLLM's own rotation the RoPE check allows (3).
"""

from __future__ import annotations

import re
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


_CHECK = re.compile(
    r"RoPE check (passed|failed): 30 layers at positions \[0, 1, \d+, \d+\], "
    r"largest error ([0-9.e+-]+) \(bound ([0-9.e+-]+)\)"
)
# One line per figure (vLLM's formatter may prefix each line of a multi-line record).
_FIGURE = re.compile(
    r"model\.layers\.\d+\.self_attn\.attn at position \d+: error [0-9.e+-]+ "
    r"\(bound [0-9.e+-]+\)$",
    re.M,
)


def _rope_check(engine: Any) -> tuple[bool, float, float, int]:
    """The worker's logged RoPE check: passed, largest error, bound, figure lines."""
    log = engine.log_path.read_text(errors="replace")
    found = set(_CHECK.findall(log))  # the refusal repeats the summary
    assert len(found) == 1, found  # one worker, one check
    ((outcome, error, bound),) = found
    return outcome == "passed", float(error), float(bound), len(_FIGURE.findall(log))


def test_wrong_rope_base_is_refused_and_the_engine_answers_as_prefix_mode(
    engines: EngineFactory, server: CacheServerProc
) -> None:
    # save off: the report prompt's own blocks never become an exact prefix for its
    # second run, which must run exactly as its first.
    engine = engines(dtype="float32", connector=_connector(server, WRONG_BASE, save=False))
    passed, error, bound, figures = _rope_check(engine)
    assert not passed
    assert error > 0.1 and bound == 1e-3  # a right description is at fp32 rounding (~1e-7)
    assert figures == 30 * 4  # every layer at every position, logged
    log = engine.log_path.read_text(errors="replace")
    assert "blend correctness gate" not in log  # nothing to blend: the gate never ran
    # The scheduler half, through the start-up handshake.
    assert "position-independent reuse refused by a worker, exact prefixes only" in log

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
    assert not _rope_check(storer)[0]  # the same description: exact prefix keys only
    # Each whole block is one exact entry at least (the chunks come on top): wait for
    # the store queue to land them, an event (seconds on an idle machine).
    wait_stored(server.address, at_least=entries + len(chat) // BLOCK)
    storer.stop()

    before = _metrics(engine)
    out = engine.generate_many([report], max_tokens=8, logprobs=5)[0]
    after = _metrics(engine)
    # A blend engine claims up to the system prompt's end here; this one claims nothing:
    # no exact prefix, and no position-independent block was stored or looked up.
    assert out["cached"] == 0
    assert after.get("lookups", 0.0) - before.get("lookups", 0.0) == 1
    assert after.get("claimed_pi_tokens", 0.0) == 0.0
    assert after.get("blend_claimed_tokens", 0.0) == 0.0
    assert after.get("rope_check_failed", 0.0) == 1.0  # counted once, by its one worker
    assert out["ids"] == base["ids"]
    assert out["logprobs"] == base["logprobs"]
    engine.stop()


def test_wrong_rope_scaling_is_refused_by_the_rope_check(
    engines: EngineFactory, server: CacheServerProc
) -> None:
    engine = engines(dtype="float32", connector=_connector(server, WRONG_SCALING))
    passed, error, _, figures = _rope_check(engine)
    assert not passed and error > 0.1 and figures == 30 * 4
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
    passed, error, bound, figures = _rope_check(engine)
    assert passed and 0.0 < error <= bound == 4 * 2**-7 and figures == 0
    engine.stop()
