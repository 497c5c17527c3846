"""SGLang's real KV pools on the CPU: a device pool and host pools over it, built as its
cache controller builds them.

Shared by the SGLang tests (tests/integrations/sglang/conftest.py) and the SGLang bench
(bench/sglang_pages.py); both run in ``.venv-sglang``.
"""

from __future__ import annotations

from tests.support.sglang_cpu import prepare_sglang_import

prepare_sglang_import()

import json  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402

__all__ = ["cpu_device_pool", "host_pool_over", "tiny_model_config", "tiny_model_folder"]


def cpu_device_pool(
    *,
    tokens: int,
    page_size: int,
    layers: int,
    heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.bfloat16,
) -> MHATokenToKVPool:
    """A real device KV pool of ``tokens`` slots on the CPU (bf16 unless ``dtype``)."""
    return MHATokenToKVPool(
        size=tokens,
        page_size=page_size,
        dtype=dtype,
        head_num=heads,
        head_dim=head_dim,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )


def host_pool_over(
    device: MHATokenToKVPool, layout: str, *, page_size: int, budget_bytes: int
) -> MHATokenToKVPoolHost:
    """A real host pool twice ``device``'s size in ``layout`` (its memory left as allocated).

    SGLang sizes a host pool against the machine's free RAM minus a reserve of several GiB,
    which on a shared machine can be below zero; its own scope books the pool against
    ``budget_bytes`` instead.
    """
    info = device.get_device_pool_infos()[0].buffer_info
    with host_memory_budget_scope(budget_bytes):
        return MHATokenToKVPoolHost(
            info,
            2.0,
            0,
            page_size,
            layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=device.size,
            start_layer=device.start_layer,
            end_layer=device.end_layer,
        )


def tiny_model_folder(
    folder: Path, *, layers: int, heads: int, head_dim: int, **config: Any
) -> Path:
    """A Llama checkpoint folder of the pools' shape: config.json (``config`` overrides
    its keys) and a small real safetensors file (SGLang never loads it here)."""
    folder.mkdir(parents=True, exist_ok=True)
    values: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": heads * head_dim,
        "intermediate_size": 2 * heads * head_dim,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": head_dim,
        "num_hidden_layers": layers,
        "vocab_size": 128,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "dtype": "bfloat16",
        **config,
    }
    (folder / "config.json").write_text(json.dumps(values))
    weights = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    save_file({"model.embed_tokens.weight": weights}, str(folder / "model.safetensors"))
    return folder


def tiny_model_config(folder: Path, **model_config: Any) -> ModelConfig:
    """SGLang's ``ModelConfig`` of ``folder`` as ``--model-path folder`` builds it (bf16,
    2048 tokens of context unless ``model_config`` says otherwise)."""
    args: dict[str, Any] = {"dtype": "bfloat16", "context_length": 2048, **model_config}
    return ModelConfig(model_path=str(folder), **args)
