"""A prompt's block keys, computed the way the client computes them (keyplan.py).

A prompt is token ids (``--tokens 1,2,3``) or text with a tokenizer folder
(``--text ... --tokenizer DIR``: its ``tokenizer.json``, special tokens added as the
tokenizer's defaults say, like ``AutoTokenizer``'s ``encode``). Keys hash the model's
fingerprint, so the model must be named as the engine that stored the blocks names it:

    --model DIR        a Hugging Face model folder (its config.json): layers, KV heads,
                       head size and RoPE come from it
    --model-name NAME  the name the engine fingerprints with (default: DIR as given,
                       what the transformers adapter uses when it loaded the folder)
    --revision REV     (default empty)     --dtype NAME  (default: config.json's)
    --form nope|rope   the stored form of exact-prefix blocks (nope: transformers
                       adapter; rope: the vLLM connector)

The namespace and chunk sizes (``prefix_block_tokens``, ``chunk_*_tokens``) come from the
client URL, as for the engine's client. Both key kinds are listed: the exact-prefix chain
and the position-independent content keys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from nopecache.admin.errors import AdminError, ExitCode
from nopecache.client.chunking import FixedChunker, token_array
from nopecache.client.config import ClientConfig
from nopecache.client.errors import InvalidArgumentError
from nopecache.client.fingerprint import ModelFingerprint
from nopecache.client.keyplan import KeyPlanner
from nopecache.client.keys import BlockKey
from nopecache.kernels import RopeSpec
from nopecache.proto.block import StoredForm

__all__ = ["ModelSpec", "PromptKey", "parse_keys", "parse_token_ids", "prompt_keys", "tokenize"]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """How the engine that stored the blocks names its model (module docstring)."""

    folder: str
    name: str | None = None
    revision: str = ""
    dtype: str | None = None
    form: str = "nope"


@dataclass(frozen=True, slots=True)
class PromptKey:
    """One block key of a prompt: its kind ("prefix" or "content"), token span, key."""

    kind: str
    start: int
    end: int
    key: bytes


def parse_token_ids(text: str) -> list[int]:
    """``"1,2,3"`` (commas and/or spaces) -> token ids; AdminError (usage) naming the bad one."""
    ids = []
    for part in text.replace(",", " ").split():
        try:
            value = int(part)
        except ValueError:
            raise AdminError(ExitCode.USAGE, f"--tokens: {part!r} is not an integer") from None
        if value < 0:
            raise AdminError(ExitCode.USAGE, f"--tokens: {value} is negative")
        ids.append(value)
    if not ids:
        raise AdminError(ExitCode.USAGE, "--tokens: no token ids given")
    return ids


def parse_keys(text: str) -> list[bytes]:
    """``"HEX,HEX"`` -> 16-byte keys; AdminError (usage) naming the bad one."""
    keys = []
    for part in text.replace(",", " ").split():
        try:
            keys.append(bytes(BlockKey.from_hex(part)))
        except (InvalidArgumentError, ValueError) as e:
            raise AdminError(ExitCode.USAGE, f"--keys: {part!r}: {e}") from None
    if not keys:
        raise AdminError(ExitCode.USAGE, "--keys: no keys given")
    return keys


def tokenize(text: str, folder: str) -> list[int]:
    """Token ids of ``text`` by the tokenizer in ``folder`` (its tokenizer.json)."""
    path = Path(folder).expanduser() / "tokenizer.json"
    if not path.is_file():
        raise AdminError(ExitCode.NOT_FOUND, f"--tokenizer: no tokenizer.json in {folder}")
    try:
        from tokenizers import Tokenizer  # optional: only --text needs it
    except ImportError:
        raise AdminError(
            ExitCode.USAGE, "--text: needs the 'tokenizers' package (pip install tokenizers)"
        ) from None
    ids: list[int] = Tokenizer.from_file(str(path)).encode(text).ids
    if not ids:
        raise AdminError(ExitCode.USAGE, "--text: the text has no tokens")
    return ids


def fingerprint_of(spec: ModelSpec) -> ModelFingerprint:
    """The fingerprint an engine serving ``spec`` keys its blocks with."""
    path = Path(spec.folder).expanduser() / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdminError(ExitCode.NOT_FOUND, f"--model: no config.json in {spec.folder}") from None
    except (OSError, ValueError) as e:
        raise AdminError(ExitCode.USAGE, f"--model: cannot read {path}: {e}") from None
    try:
        layers = int(config["num_hidden_layers"])
        kv_heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    except (KeyError, TypeError, ValueError) as e:
        raise AdminError(ExitCode.USAGE, f"--model: {path}: missing or bad {e}") from None
    dtype = spec.dtype or config.get("torch_dtype") or config.get("dtype")
    if not dtype:
        raise AdminError(ExitCode.USAGE, f"--dtype: {path} names no dtype; give one")
    try:
        form = {"nope": StoredForm.NOPE, "rope": StoredForm.ROPE}[spec.form]
        return ModelFingerprint.from_rope_spec(
            model=spec.name if spec.name is not None else spec.folder,
            revision=spec.revision,
            num_layers=layers,
            num_kv_heads=kv_heads,
            dtype=dtype,
            form=form,
            rope=RopeSpec.from_hf_config(config),
        )
    except KeyError:
        raise AdminError(ExitCode.USAGE, f"--form: {spec.form!r} is not nope or rope") from None
    except (InvalidArgumentError, ValueError) as e:
        raise AdminError(ExitCode.USAGE, f"--model: {e}") from None


def prompt_keys(tokens: list[int], model: ModelSpec, config: ClientConfig) -> list[PromptKey]:
    """The exact-prefix chain, then the content keys, of ``tokens`` (client keying)."""
    chunker = config.content_chunker()
    planner = KeyPlanner(
        fingerprint_of(model),
        config.namespace,
        FixedChunker(config.prefix_block_tokens),
        chunker,
        chunker,
    )
    try:
        prefix, content = planner.keys(token_array(tokens), None, chunker, prefix=True, pi=True)
    except InvalidArgumentError as e:
        raise AdminError(ExitCode.USAGE, f"prompt: {e}") from None
    return [PromptKey("prefix", c.span.start, c.span.end, bytes(c.key)) for c in prefix] + [
        PromptKey("content", c.span.start, c.span.end, bytes(c.key)) for c in content
    ]
