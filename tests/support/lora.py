"""Seeded LoRA adapters for SmolLM2 in PEFT format, built by the tests (nothing downloaded).

``write_adapter(folder, seed)`` writes ``adapter_config.json`` and
``adapter_model.safetensors`` (what vLLM's ``LoRARequest(lora_path=...)`` loads): rank-8
low-rank weights on ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` of every layer, drawn
from one seed, so two seeds give two adapters whose greedy outputs differ from each other
and from the base model (the parity harness needs requests whose KV really differs per
adapter). The weights are numpy arrays written with ``safetensors.numpy``: the module runs
in every environment, with or without torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

RANK = 8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# delta W = B @ A * ALPHA / RANK. With A ~ N(0, 1/in) and B ~ N(0, SCALE^2) the delta of a
# projection adds about SCALE * ALPHA / RANK * sqrt(RANK) times the input's norm: 1 x
# here, large enough that a 135M model's greedy tokens change within a few steps, small
# enough that the text stays a model's text (not NaNs).
ALPHA = 16
SCALE = 0.2


def _shapes(config: dict[str, int]) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target projection."""
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q = config["num_attention_heads"] * head_dim
    kv = config["num_key_value_heads"] * head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
    }


def write_adapter(folder: Path, seed: int, model_dir: str | Path) -> Path:
    """Write a seeded rank-8 PEFT LoRA adapter for the model in ``model_dir``; return its folder."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (fan_in, fan_out) in _shapes(config).items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            a = rng.normal(0.0, fan_in**-0.5, (RANK, fan_in))
            b = rng.normal(0.0, SCALE, (fan_out, RANK))
            tensors[f"{prefix}.lora_A.weight"] = a.astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = b.astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return folder
