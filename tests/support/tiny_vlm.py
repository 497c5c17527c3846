"""A tiny SmolVLM-shaped (Idefics3) model for multimodal engine tests: config, processor
and tokenizer built here from SmolLM2's tokenizer, seeded random weights. Nothing is
downloaded.

Why Idefics3: it is SmolVLM's architecture, built on SmolLM2 (a Llama), and vLLM's CPU
build imports it without torchvision (LLaVA's module pulls Pixtral's image processor,
which needs torchvision, and the vLLM environment has none). Its processor, with image
splitting off, expands one ``<image>`` into ``<fake_token_around_image><global-img>``,
``IMAGE_TOKENS`` ``<image>`` placeholders and ``<fake_token_around_image>``: two images
of the same size give identical prompt token ids, exactly the case where a key made of
token ids alone serves one image's KV to another.

Geometry: 128x128-pixel images in 16-pixel patches (64 patches, pixel-shuffled by 2 into
16 image tokens), one vision layer of width 64; the text model has 2 layers, hidden 128,
2 query heads and 1 KV head of 64 (a head size vLLM's CPU attention takes). Weights are
drawn like :mod:`tests.support.tiny_llama` (std 1/sqrt(fan_in), untied head), so greedy
answers depend on every input, image pixels included.

    python -m tests.support.tiny_vlm OUT_DIR SMOLLM2_DIR   (in the vLLM environment)
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

__all__ = ["IMAGE_SIZE", "IMAGE_TOKENS", "SEED", "write_tiny_vlm"]

SEED = 20261206
IMAGE_SIZE = 128
PATCH = 16
SCALE = 2  # Idefics3's pixel shuffle: SCALE x SCALE patches per image token
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2 // SCALE**2
_SPECIAL = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)
]


def _config(vocab: int, image_token: int) -> dict[str, Any]:
    text = {
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "num_hidden_layers": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05,
        "rope_theta": 100000.0,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    vision = {
        "model_type": "idefics3_vision",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH,
    }
    return {
        "text_config": text,
        "vision_config": vision,
        "image_token_id": image_token,
        "scale_factor": SCALE,
        "pad_token_id": 2,
        "tie_word_embeddings": False,
    }


def write_tiny_vlm(out: Path, tokenizer_dir: Path) -> Path:
    """Write config, processor, tokenizer and seeded weights to ``out`` (idempotent)."""
    import torch
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
    )

    if (out / "model.safetensors").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": _SPECIAL})
    image_token = int(tok.convert_tokens_to_ids("<image>"))  # type: ignore[arg-type,unused-ignore]
    vocab = len(tok)
    config = Idefics3Config(**_config(vocab, image_token))
    config.architectures = ["Idefics3ForConditionalGeneration"]
    torch.manual_seed(SEED)
    model = Idefics3ForConditionalGeneration(config)
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:  # std 1/sqrt(fan_in); embeddings (rows = vocab) std 1
                std = 1.0 if "embed_tokens" in name else param.shape[1] ** -0.5
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    model.save_pretrained(str(tmp), safe_serialization=True)
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessor(
            do_image_splitting=False,
            size={"longest_edge": IMAGE_SIZE},
            max_image_size={"longest_edge": IMAGE_SIZE},
        ),
        tokenizer=tok,
        image_seq_len=IMAGE_TOKENS,
    )
    processor.save_pretrained(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # last: a folder with weights is complete
    return out


if __name__ == "__main__":
    print(write_tiny_vlm(Path(sys.argv[1]), Path(sys.argv[2])))
