"""Connector parts checked against vLLM itself, without starting an engine."""

from __future__ import annotations

import pytest
import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.engine.arg_utils import EngineArgs

from nopecache.client.adapters.vllm import NopecacheConnector, _verify_cpu_layout
from nopecache.client.adapters.vllm_config import (
    ConnectorConfigError,
    UnsupportedEngineError,
    model_identity,
)
from nopecache.client.adapters.vllm_layout import CpuAttnLayout, UnsupportedLayoutError
from nopecache.kernels import RopeSpec
from nopecache.proto.block import StoredForm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [32, 128])
def test_cpu_layout_reads_what_vllm_writes(dtype: torch.dtype, block_size: int) -> None:
    _verify_cpu_layout(CpuAttnLayout(block_size, 3, 64), dtype)  # raises on any mismatch


class _KRowMajor(CpuAttnLayout):
    """A wrong guess: K stored [block_size, head_dim] like V."""

    def k_view(self, cache: torch.Tensor) -> torch.Tensor:
        bs, d = self.block_size, self.head_dim
        return cache.as_strided(
            (cache.shape[0], bs, self.num_kv_heads, d), (cache.stride(0), d, cache.stride(1), 1)
        )


def test_a_layout_vllm_does_not_write_is_refused() -> None:
    with pytest.raises(UnsupportedLayoutError, match="does not write the layout"):
        _verify_cpu_layout(_KRowMajor(128, 3, 64), torch.bfloat16)


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
        kv_connector_module_path="nopecache.client.adapters.vllm",
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
