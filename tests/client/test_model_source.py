"""The model source: config digest, RoPE length rule and weights digest, engine-free."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from nopecache.client import InvalidArgumentError
from nopecache.client.model_source import (
    LENGTH_FREE_ROPE_TYPES,
    VOLATILE_CONFIG_KEYS,
    ModelSource,
    config_digest,
    rope_max_len,
    rope_types,
    weights_digest,
)

CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "id2label": {0: "a", 1: "b"},
    "dtype": torch.bfloat16,
    "_commit_hash": "abc",
    "transformers_version": "5.24.0",
    "_name_or_path": "/models/a",
}


def test_config_digest_ignores_key_order_and_every_volatile_key() -> None:
    base = config_digest(CONFIG)
    assert config_digest(dict(reversed(list(CONFIG.items())))) == base
    for key in VOLATILE_CONFIG_KEYS:
        assert config_digest({**CONFIG, key: "something else"}) == base, key
    stripped = {k: v for k, v in CONFIG.items() if k not in VOLATILE_CONFIG_KEYS}
    assert config_digest(stripped) == base
    assert config_digest({**stripped, "dtype": "bfloat16"}) == base  # torch.dtype canonical
    assert len(base) == 16


@pytest.mark.parametrize(
    "change",
    [
        {"num_hidden_layers": 3},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10001.0}},
        {"id2label": {0: "a", 1: "c"}},
        {"vocab_size": 1},
        {"dtype": torch.float16},
    ],
)
def test_config_digest_changes_with_any_other_key(change: dict[str, object]) -> None:
    assert config_digest({**CONFIG, **change}) != config_digest(CONFIG)


def test_config_digest_refuses_values_that_are_not_json_data() -> None:
    with pytest.raises(InvalidArgumentError, match=r"^config: config\.x\[1\] is a object"):
        config_digest({"x": [1, object()]})


@pytest.mark.parametrize(
    ("config", "types"),
    [
        ({}, {"default"}),
        ({"rope_parameters": None, "rope_scaling": None}, {"default"}),
        ({"rope_parameters": {"rope_theta": 1.0}}, {"default"}),
        ({"rope_scaling": {"type": "su", "short_factor": [1.0]}}, {"su"}),
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "yarn", "factor": 4.0},
                    "sliding_attention": {"rope_type": "default"},
                }
            },
            {"yarn", "default"},
        ),
    ],
)
def test_rope_types_reads_flat_nested_and_legacy_parameters(
    config: dict[str, object], types: set[str]
) -> None:
    assert rope_types(config) == types


@pytest.mark.parametrize("kind", sorted(LENGTH_FREE_ROPE_TYPES))
def test_plain_linear_and_llama3_rope_do_not_depend_on_max_model_len(kind: str) -> None:
    assert rope_max_len({kind, "default"}, 4096) == 0


@pytest.mark.parametrize("kind", ["dynamic", "longrope", "su", "yarn", "deepseek_yarn", "new"])
def test_every_other_rope_folds_max_model_len_in(kind: str) -> None:
    assert rope_max_len({"default", kind}, 4096) == 4096
    assert rope_max_len({kind}, 8192) == 8192


def test_rope_max_len_refuses_a_bad_length() -> None:
    with pytest.raises(InvalidArgumentError, match=r"^max_model_len: "):
        rope_max_len({"yarn"}, 0)


def _checkpoint(folder: Path, body: bytes) -> Path:
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(body)
    (folder / "config.json").write_text("{}")
    return folder


BODY = bytes(range(256)) * 4096  # 1 MiB: far more than the ~200 KiB the digest reads


def test_weights_digest_sees_weights_replaced_in_place(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path / "m", BODY)
    before = weights_digest(str(folder))
    assert len(before) == 16
    # A fine-tune of the same shape: same file name and size, other bytes.
    tuned = bytes((b + 1) % 256 for b in BODY)
    (folder / "model.safetensors").write_bytes(tuned)
    assert weights_digest(str(folder)) != before


def test_weights_digest_sees_one_changed_window_and_the_header(tmp_path: Path) -> None:
    base = weights_digest(str(_checkpoint(tmp_path / "a", BODY)))
    header = bytearray(BODY)
    header[100] ^= 1
    assert weights_digest(str(_checkpoint(tmp_path / "b", bytes(header)))) != base
    middle = bytearray(BODY)
    middle[(64 << 10) + (len(BODY) - (68 << 10)) * 7 // 31] ^= 1  # inside window 7
    assert weights_digest(str(_checkpoint(tmp_path / "c", bytes(middle)))) != base


def test_copies_of_one_checkpoint_share_the_digest(tmp_path: Path) -> None:
    """A fleet copies one checkpoint to every node: other paths and mtimes, same digest."""
    folder = _checkpoint(tmp_path / "m", BODY)
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)  # copytree keeps mtimes: change them
    os.utime(copy / "model.safetensors", (1_000_000, 1_000_000))
    assert weights_digest(str(copy)) == weights_digest(str(folder))
    (copy / "notes.txt").write_text("not a weight file")
    assert weights_digest(str(copy)) == weights_digest(str(folder))
    (copy / "model-2.safetensors").write_bytes(b"x")
    assert weights_digest(str(copy)) != weights_digest(str(folder))


def test_hub_ids_and_folders_without_weights_have_no_weights_digest(tmp_path: Path) -> None:
    assert weights_digest("HuggingFaceTB/SmolLM2-135M") == b""
    (tmp_path / "config.json").write_text("{}")
    assert weights_digest(str(tmp_path)) == b""


def test_a_single_file_checkpoint_is_digested(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    first = weights_digest(str(gguf))
    gguf.write_bytes(b"GGUF" + bytes(99) + b"\x01")
    assert len(first) == 16 and weights_digest(str(gguf)) != first


def test_derive_fills_every_field(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path / "m", BODY)
    config = {"model_type": "llama", "rope_parameters": {"rope_type": "default"}}
    source = ModelSource.derive(
        model=str(folder),
        revision="",
        quantization="fp8",
        text_config=config,
        max_model_len=2048,
    )
    assert source == ModelSource(
        model=str(folder),
        revision="",
        quantization="fp8",
        config_digest=config_digest(config),
        weights_digest=weights_digest(str(folder)),
        rope_max_len=0,
    )
    moved = ModelSource.derive(
        model=str(folder),
        revision="",
        quantization="fp8",
        text_config=config,
        max_model_len=2048,
        rope_types_applied=["dynamic"],  # e.g. the connector's rope_override
    )
    assert moved.rope_max_len == 2048
