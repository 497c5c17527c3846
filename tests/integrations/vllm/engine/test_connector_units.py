"""Connector parts checked against vLLM itself, without starting an engine."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.engine.arg_utils import EngineArgs

from nopecache.integrations.vllm.blend import blend_unsupported_reason
from nopecache.integrations.vllm.blend_loop import BlendUnavailableError, find_model
from nopecache.integrations.vllm.compat import verify_cpu_layout
from nopecache.integrations.vllm.config import (
    ConnectorConfigError,
    UnsupportedEngineError,
    model_identity,
)
from nopecache.integrations.vllm.connector import NopecacheConnector
from nopecache.integrations.vllm.layout import CpuAttnLayout, UnsupportedLayoutError
from nopecache.kernels import RopeSpec
from nopecache.proto.block import StoredForm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [32, 128])
def test_cpu_layout_reads_what_vllm_writes(dtype: torch.dtype, block_size: int) -> None:
    verify_cpu_layout(CpuAttnLayout(block_size, 3, 64), dtype)  # raises on any mismatch


class _KRowMajor(CpuAttnLayout):
    """A wrong guess: K stored [block_size, head_dim] like V."""

    def k_view(self, cache: torch.Tensor) -> torch.Tensor:
        bs, d = self.block_size, self.head_dim
        return cache.as_strided(
            (cache.shape[0], bs, self.num_kv_heads, d), (cache.stride(0), d, cache.stride(1), 1)
        )


def test_a_layout_vllm_does_not_write_is_refused() -> None:
    with pytest.raises(UnsupportedLayoutError, match="does not write the layout"):
        verify_cpu_layout(_KRowMajor(128, 3, 64), torch.bfloat16)


def _vllm_config(model_dir: str, **kwargs: object) -> object:
    return EngineArgs(model=model_dir, enforce_eager=True, **kwargs).create_engine_config()  # type: ignore[arg-type,unused-ignore]


def test_fingerprint_comes_from_vllms_config(model_dir: str) -> None:
    ident = model_identity(_vllm_config(model_dir, dtype="bfloat16"))
    fp = ident.fingerprint
    assert (fp.num_layers, fp.num_kv_heads, fp.head_dim, fp.dtype) == (30, 3, 64, "bfloat16")
    assert fp.form is StoredForm.ROPE
    assert fp.model == model_dir
    assert ident.block_size == 128
    from transformers import AutoConfig

    assert fp.rope_digest == RopeSpec.from_hf_config(AutoConfig.from_pretrained(model_dir)).digest()
    fp32 = model_identity(_vllm_config(model_dir, dtype="float32")).fingerprint
    assert fp32.dtype == "float32" and fp32.digest() != fp.digest()


def _connector(
    model_dir: str, role: KVConnectorRole, extra: dict[str, object]
) -> NopecacheConnector:
    transfer = KVTransferConfig(
        kv_connector="NopecacheConnector",
        kv_connector_module_path="nopecache.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )
    config = _vllm_config(model_dir, dtype="bfloat16", kv_transfer_config=transfer)
    return NopecacheConnector(config, role)  # type: ignore[arg-type,unused-ignore]


URL = "nopecache://127.0.0.1:1"  # nothing listens: the connector must start anyway


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"url": URL, "pi_reuse": "sideways"}, "['pi_reuse']: must be one of off, contiguous"),
        ({"url": URL, "urll": 1}, "kv_connector_extra_config['urll']: unknown key"),
        ({}, "kv_connector_extra_config['url']: is required"),
    ],
)
def test_bad_extra_config_stops_the_connector_naming_the_key(
    model_dir: str, extra: dict[str, object], message: str
) -> None:
    with pytest.raises(ConnectorConfigError) as err:
        _connector(model_dir, KVConnectorRole.SCHEDULER, extra)
    assert message in str(err.value)


def test_scheduler_connector_makes_load_failures_recompute(model_dir: str) -> None:
    connector = _connector(model_dir, KVConnectorRole.SCHEDULER, {"url": URL})
    try:
        assert connector._kv_transfer_config.kv_load_failure_policy == "recompute"
    finally:
        connector.shutdown()


def test_worker_connector_refuses_an_unknown_layout(model_dir: str) -> None:
    connector = _connector(model_dir, KVConnectorRole.WORKER, {"url": URL})
    try:
        caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(4, 128, 3, 64) for i in range(30)}
        with pytest.raises(UnsupportedLayoutError, match=r"shape \[4, 128, 3, 64\], stride"):
            connector.register_kv_caches(caches)
        good = {
            f"model.layers.{i}.self_attn.attn": torch.zeros(4, 3, 128, 128, dtype=torch.bfloat16)
            for i in range(30)
        }
        connector.register_kv_caches(good)  # the CPU_ATTN layout, checked against vLLM's op
    finally:
        connector.shutdown()


def test_quantized_kv_is_refused(model_dir: str) -> None:
    with pytest.raises(UnsupportedEngineError, match="kv_cache_dtype='fp8'"):
        model_identity(_vllm_config(model_dir, dtype="bfloat16", kv_cache_dtype="fp8"))


def test_blend_mode_is_supported_for_smollm2_on_cpu(model_dir: str) -> None:
    assert blend_unsupported_reason(_vllm_config(model_dir, dtype="float32")) is None


def test_blend_mode_refuses_what_the_loop_cannot_run(model_dir: str) -> None:
    config: Any = _vllm_config(model_dir, dtype="float32")
    config.model_config.model_arch_config.architectures = ["GPT2LMHeadModel"]
    reason = blend_unsupported_reason(config)
    assert reason is not None and "['GPT2LMHeadModel'] is not one the layer loop runs" in reason
    config = _vllm_config(model_dir, dtype="float32")
    config.model_config.hf_text_config.sliding_window = 256
    config.model_config.hf_text_config.use_sliding_window = True
    reason = blend_unsupported_reason(config)
    assert reason is not None and "sliding-window attention (sliding_window=256)" in reason


def test_an_unsupported_engine_starts_in_prefix_mode_saying_why(
    model_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    transfer = KVTransferConfig(
        kv_connector="NopecacheConnector",
        kv_connector_module_path="nopecache.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"url": URL, "pi_reuse": "blend"},
    )
    config: Any = _vllm_config(model_dir, dtype="float32", kv_transfer_config=transfer)
    config.model_config.model_arch_config.architectures = ["GPT2LMHeadModel"]
    with caplog.at_level(logging.WARNING):
        scheduler = NopecacheConnector(config, KVConnectorRole.SCHEDULER)
        worker = NopecacheConnector(config, KVConnectorRole.WORKER)
    try:
        assert "pi_reuse='blend' unsupported here (model architecture" in caplog.text
        assert scheduler._scheduler is not None and not scheduler._scheduler.blend
        assert worker._worker is not None and worker._worker.blend_unavailable is not None
    finally:
        scheduler.shutdown()
        worker.shutdown()


def test_worker_finds_the_served_model_by_its_attention_layers() -> None:
    class Attn(torch.nn.Module):
        pass

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self_attn = torch.nn.Module()
            self.self_attn.attn = Attn()

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList([Layer(), Layer()])

    served, other = Model(), Model()  # the other model's layers are not the registered ones
    names = [f"model.layers.{i}.self_attn.attn" for i in (0, 1)]
    layers = {name: served.get_submodule(name) for name in names}
    assert find_model(layers) is served
    assert find_model({name: other.get_submodule(name) for name in names}) is other
    with pytest.raises(BlendUnavailableError, match="0 module trees"):
        find_model({"model.layers.0.self_attn.attn": Attn()})


def test_rope_override_replaces_the_described_rope(model_dir: str) -> None:
    own = model_identity(_vllm_config(model_dir, dtype="float32"))
    linear = {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0}
    moved = model_identity(_vllm_config(model_dir, dtype="float32"), rope_override=linear)
    assert moved.rope.scaling_type == "linear"
    assert moved.rope.inv_freq == tuple(f / 2 for f in own.rope.inv_freq)
    # Another description, other keys: blocks of the two never mix.
    assert moved.fingerprint.digest() != own.fingerprint.digest()
    with pytest.raises(ConnectorConfigError, match=r"\['rope_override'\]: unknown rope type"):
        model_identity(
            _vllm_config(model_dir, dtype="float32"), rope_override={"rope_type": "sideways"}
        )


def test_a_worker_refusal_puts_the_scheduler_in_prefix_mode(model_dir: str) -> None:
    from nopecache.integrations.vllm.connector import NopecacheHandshake

    connector = _connector(model_dir, KVConnectorRole.SCHEDULER, {"url": URL, "pi_reuse": "blend"})
    try:
        side = connector._scheduler_side()
        assert side.blend and side.policy is not None
        connector.set_xfer_handshake_metadata({0: NopecacheHandshake(None)})
        assert side.blend  # a worker that blends changes nothing
        connector.set_xfer_handshake_metadata({0: NopecacheHandshake("gate refused: ...")})
        assert not side.blend and side.policy is None
    finally:
        connector.shutdown()
