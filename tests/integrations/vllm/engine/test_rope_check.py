"""The start-up RoPE check against vLLM's own rotary modules, without starting an engine.

vLLM's ``get_rope`` builds each rotary embedding the way a vLLM model's attention layer
does; the modules sit in a module tree at the names vLLM registers attention layers
under, as in a served model. The connector's halves run against a real server
(tests/support/vllm_halves.py: a tiny Llama, RoPE theta 10000, head dim 8, NeoX layout).
A spec vLLM's rotation reproduces passes; a mismatch (another theta, as a wrong
``rope_override`` gives, the GPT-J pair layout, a scaling the spec does not name, a
layer that does not rotate) turns position-independent store and load off: the worker
stores exact-prefix keys only, the scheduler half looks up exact prefixes only, every
figure is logged and the refusal is counted.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope

from nopecache.integrations.vllm.connector import NopecacheHandshake
from nopecache.integrations.vllm.metrics import NopecachePromMetrics, NopecacheStats
from nopecache.integrations.vllm.rope_check import module_rotations
from nopecache.kernels.rope_check import check_positions, check_rope
from nopecache.recompute.gate import DEFAULT_THRESHOLDS
from tests.support.server_procs import CacheServerProc
from tests.support.vllm_halves import DIM, HEADS, LAYERS, _Engine, _identity, _request

MAX_LEN = 2048  # LlamaConfig's max_position_embeddings: the tiny Llama's context
PROMPT = list(range(100, 114))  # 14 tokens: 3 whole blocks and a partial one
WORKER_LOG = "vllm.nopecache.integrations.vllm.worker"


@pytest.fixture(autouse=True, scope="module")
def _vllm_config() -> Iterator[None]:
    # vLLM's custom ops (the rotary embeddings) read the current config when built.
    with set_current_vllm_config(VllmConfig()):
        yield


def _rotary(
    theta: float = 10000.0, neox: bool = True, dtype: torch.dtype = torch.float32, **extra: Any
) -> nn.Module:
    params = {"rope_type": "default", "rope_theta": theta, **extra}
    return get_rope(DIM, MAX_LEN, is_neox_style=neox, rope_parameters=params, dtype=dtype)


def _served(*rotaries: nn.Module | None) -> tuple[nn.Module, list[str]]:
    """A module tree shaped as vLLM's Llama: ``model.layers.i.self_attn.{attn,rotary_emb}``."""
    layers = nn.ModuleList()
    for rotary in rotaries:
        attn = nn.Module()
        attn.attn = nn.Identity()
        if rotary is not None:
            attn.rotary_emb = rotary
        layer = nn.Module()
        layer.self_attn = attn
        layers.append(layer)
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = layers
    return model, [f"model.layers.{i}.self_attn.attn" for i in range(len(rotaries))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_vllms_own_rotation_matches_the_spec_it_is_described_by(dtype: torch.dtype) -> None:
    model, names = _served(*(_rotary(dtype=dtype) for _ in range(LAYERS)))
    bound = DEFAULT_THRESHOLDS.for_dtype(dtype).max_rope_error
    check = check_rope(
        module_rotations(model, names),
        _identity().rope,
        positions=check_positions(MAX_LEN),
        kv_heads=HEADS,
        dtype=dtype,
        bound=bound,
    )
    assert check.passed, check.report()
    assert [(f.layer, f.position) for f in check.figures] == [
        (name, p) for name in names for p in (0, 1, 1024, 2047)
    ]
    assert all(f.bound == bound for f in check.figures)
    if dtype == torch.float32:  # one fp32 rotation against another: rounding only
        assert check.max_error < 1e-6


def _mismatch(kind: str) -> tuple[nn.Module | None, ...]:
    if kind == "theta":  # the spec says 10000, the engine rotates with 500000
        return (_rotary(500000.0), _rotary(500000.0))
    if kind == "gptj":  # interleaved pairs instead of NeoX halves
        return (_rotary(neox=False), _rotary(neox=False))
    if kind == "scaling":  # a linear scaling vLLM applies and the spec does not name
        return (_rotary(rope_type="linear", factor=2.0), _rotary(rope_type="linear", factor=2.0))
    if kind == "one_layer":  # per-layer RoPE: the second layer rotates otherwise
        return (_rotary(), _rotary(1000000.0))
    assert kind == "no_rotary"  # the second layer does not rotate at all
    return (_rotary(), None)


@pytest.fixture
def engines(cache_server: CacheServerProc) -> Iterator[tuple[_Engine, _Engine]]:
    a = _Engine(cache_server, 1, pi_reuse="contiguous")
    b = _Engine(cache_server, 2, pi_reuse="contiguous")
    yield a, b
    a.close()
    b.close()


@pytest.mark.parametrize("kind", ["theta", "gptj", "scaling", "one_layer", "no_rotary"])
def test_a_mismatch_turns_position_independent_reuse_off(
    engines: tuple[_Engine, _Engine], caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    a, b = engines
    model, names = _served(*_mismatch(kind))
    with caplog.at_level(logging.INFO, logger=WORKER_LOG):
        check = a.worker.check_rope(lambda: module_rotations(model, names), MAX_LEN)
    assert check is not None and not check.passed
    assert a.worker.pi_refused is not None and a.worker.pi_refused.startswith("RoPE check failed")
    # Every figure is logged: layer, position, error and bound, the failing ones included.
    (logged,) = [r.getMessage() for r in caplog.records if "every figure:" in r.getMessage()]
    assert logged.splitlines()[1:] == [str(figure) for figure in check.figures]
    line = re.compile(
        r"^model\.layers\.\d\.self_attn\.attn( \(no rotary embedding\))? at position \d+: error \d\.\d{3}e[+-]\d\d \(bound \d\.\d{3}e[+-]\d\d\)$"
    )
    assert sum(bool(line.match(text)) for text in logged.splitlines()) == LAYERS * 4
    bad = {f.layer for f in check.failures}
    assert bad == ({names[1]} if kind in ("one_layer", "no_rotary") else set(names))
    # Counted once, for Prometheus (vllm:nopecache_rope_check_failed_total).
    report = a.worker.take_report()
    assert report is not None and report.rope_check_failed == 1
    assert NopecacheStats.of_report(report).data["rope_check_failed"] == 1
    assert "rope_check_failed" in NopecachePromMetrics._COUNTERS
    # A stores the prompt: exact-prefix keys only, no content keys.
    a.step(_request("r1", PROMPT), [3, 0, 2, 1], 0)
    plan = b.client.lookup(PROMPT)
    assert plan.prefix_end == 12  # the exact prefix keeps working
    assert plan.hits == ()  # the partial last block would be a content (PI) hit


def test_a_refused_scheduler_looks_up_exact_prefixes_only(cache_server: CacheServerProc) -> None:
    # Blend mode looks the whole prompt up, so the stored prompt's content hit (its
    # partial last block) is there to find; the refused engine does not even ask.
    store = _Engine(cache_server, 1)
    refused = _Engine(cache_server, 2, pi_reuse="blend")
    allowed = _Engine(cache_server, 3, pi_reuse="blend")
    try:
        store.step(_request("r1", PROMPT), [3, 0, 2, 1], 0)
        handshake = NopecacheHandshake(None, "RoPE check failed: ...")
        assert handshake.pi_refused is not None
        refused.scheduler.refuse_position_independent(handshake.pi_refused)
        assert not refused.scheduler.position_independent and not refused.scheduler.blend
        for engine in (allowed, refused):
            engine.matched(_request("r2", PROMPT), 0)
        assert allowed.client.stats().pi_hit_tokens == 2
        assert refused.client.stats().pi_hit_tokens == 0
        assert refused.client.stats().prefix_hit_tokens == 12  # exact prefixes still hit
    finally:
        for engine in (store, refused, allowed):
            engine.close()


def test_a_matching_spec_keeps_position_independent_reuse(
    engines: tuple[_Engine, _Engine], caplog: pytest.LogCaptureFixture
) -> None:
    a, b = engines
    model, names = _served(_rotary(), _rotary())
    with caplog.at_level(logging.INFO, logger=WORKER_LOG):
        check = a.worker.check_rope(lambda: module_rotations(model, names), MAX_LEN)
    assert check is not None and check.passed and a.worker.pi_refused is None
    assert a.worker.take_report() is None  # nothing counted
    assert any(r.getMessage().startswith("nopecache: RoPE check passed") for r in caplog.records)
    a.step(_request("r1", PROMPT), [3, 0, 2, 1], 0)
    assert [(h.target.start, h.target.end) for h in b.client.lookup(PROMPT).hits] == [(12, 14)]


def test_a_model_the_check_cannot_reach_turns_position_independent_reuse_off(
    engines: tuple[_Engine, _Engine],
) -> None:
    a, _ = engines

    def lost() -> dict[str, Any]:
        raise RuntimeError("2 module trees hold the registered attention layers")

    assert a.worker.check_rope(lost, MAX_LEN) is None
    assert a.worker.pi_refused == (
        "the RoPE check failed to run: RuntimeError: 2 module trees hold the registered "
        "attention layers"
    )
    report = a.worker.take_report()
    assert report is not None and report.rope_check_failed == 1
