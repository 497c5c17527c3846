"""A tiny Llama model for tensor-parallel engine tests: a config shipped here, random
weights written once from a fixed seed, SmolLM2's converted tokenizer beside them.

Why real weights and not vLLM's ``load_format="dummy"``: dummy init draws each rank's
shard from its own generator, so a TP=2 engine and a TP=1 engine would serve different
models and no answer could be compared. Weights written once as safetensors are the same
bytes for every engine, whatever its TP size.

Geometry (``CONFIG``): hidden 256, 4 attention heads, 2 KV heads of 64, 2 layers,
SmolLM2's vocabulary (49152) so its tokenizer and chat template serve it unchanged. Two
KV heads split evenly over TP=2 (one head per rank).

    python -m tests.support.tiny_llama OUT_DIR SMOLLM2_DIR   (in either environment)
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

__all__ = ["CONFIG", "SEED", "write_tiny_llama"]

SEED = 20261203
CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "max_position_embeddings": 4096,
    "mlp_bias": False,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-05,
    "rope_theta": 100000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "vocab_size": 49152,
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write_tiny_llama(out: Path, tokenizer_dir: Path) -> Path:
    """Write config, seeded random weights and SmolLM2's tokenizer to ``out`` (idempotent)."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    weights = out / "model.safetensors"
    if weights.is_file():
        return out
    c = CONFIG
    hidden, inter, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q_dim, kv_dim = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    gen = torch.Generator().manual_seed(SEED)

    def rand(*shape: int) -> torch.Tensor:
        # std 1/sqrt(fan_in): activations keep their scale through the layers, so greedy
        # answers depend on the whole prompt (at 0.02 every prompt decodes one token).
        std = shape[-1] ** -0.5 if shape[0] != c["vocab_size"] else 1.0
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    # Names and shapes of transformers' LlamaForCausalLM. Untied: a head tied to the
    # embedding mostly predicts the token it just read, whatever came before.
    tensors = {
        "model.embed_tokens.weight": rand(c["vocab_size"], hidden),
        "lm_head.weight": rand(c["vocab_size"], hidden) * hidden**-0.5,
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(q_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, q_dim),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    tensors["model.norm.weight"] = torch.ones(hidden)
    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2))
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.rename(weights)  # last: a folder with weights is complete
    return out


if __name__ == "__main__":
    print(write_tiny_llama(Path(sys.argv[1]), Path(sys.argv[2])))
