"""What an engine loaded: the model-source part of a :class:`ModelFingerprint`.

Two engines share a block only when the KV in it means the same to both. The shape, dtype
and RoPE spec are in the fingerprint already; this module derives, the same way for every
engine, what tells apart two models of one shape::

    field           from                                      tells apart
    model           the model path or hub id (never the       different checkpoints
                    served name: that is a label)
    revision        the config's commit hash, else the        hub revisions of one id
                    configured revision
    quantization    the engine's weight quantization method   --quantization fp8 vs none
    config_digest   canonical JSON of the text config as the  edited configs, hf overrides
                    engine loaded it, volatile keys dropped
    weights_digest  names, sizes and sampled bytes of a       weights replaced in place
                    local folder's weight files               under the same path
    rope_max_len    max_model_len, where the engine's         the long/short LongRoPE
                    rotation depends on it                    tables, dynamic NTK, YaRN

Weights replaced in place under one path carry no commit hash, and their config may not
change (a fine-tune of the same base). Their file names, sizes and modification times are
cheap to read, but modification times differ between copies of one checkpoint (every node
of a fleet that downloads or rsyncs it gets its own), so a digest over them would keep
the nodes of a fleet from ever sharing. Hashing whole files is exact but reads every byte
(minutes for a 70B model at start-up). So the digest reads each weight file's first
64 KiB (the safetensors header: tensor names, dtypes, shapes) and 32 windows of 4 KiB
spread evenly over the rest: ~200 KiB per file, and a fine-tune changes essentially every
window. Hub ids are not read: their commit hash pins the files.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import xxhash

from nopecache.client.errors import InvalidArgumentError

__all__ = [
    "LENGTH_FREE_ROPE_TYPES",
    "VOLATILE_CONFIG_KEYS",
    "ModelSource",
    "config_digest",
    "rope_max_len",
    "rope_types",
    "weights_digest",
]

VOLATILE_CONFIG_KEYS: Mapping[str, str] = {
    # Where the config was read from, not what it says: set when it came through the hub
    # cache, absent for a local copy of the same files. The revision field holds it.
    "_commit_hash": "load location (held as the revision)",
    # The transformers release that read (or last wrote) the file: to_dict() reports the
    # running library's version, so two engines on different releases would never share.
    "transformers_version": "library version, not the model",
    # The path the config was loaded from: the model field holds it; copied folders with
    # identical contents must not differ here.
    "_name_or_path": "load location (held as the model)",
    # transformers' own attention-kernel choice; engines run their own attention.
    "_attn_implementation": "transformers' kernel choice",
    "_attn_implementation_autoset": "transformers' kernel choice",
}
"""Keys of ``PretrainedConfig.to_dict()`` left out of the config digest, and why."""

LENGTH_FREE_ROPE_TYPES = frozenset({"default", "linear", "llama3", "proportional", "mrope"})
"""RoPE types whose rotation is the same at every max_model_len ("mrope" is the old name
of "default" with sections). Every other type (dynamic NTK, longrope/su, yarn and its
variants, and any type not listed) folds the engine's max_model_len into the fingerprint:
vLLM picks LongRoPE's long or short table by it, and NTK/YaRN tables depend on lengths."""

_HEAD_BYTES = 64 << 10
_WINDOWS = 32
_WINDOW_BYTES = 4 << 10
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


@dataclass(frozen=True, slots=True)
class ModelSource:
    """The model-source fields of a fingerprint (see the module docstring)."""

    model: str
    revision: str
    quantization: str = ""
    config_digest: bytes = b""
    weights_digest: bytes = b""
    rope_max_len: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise InvalidArgumentError("model", f"must be a non-empty str, got {self.model!r}")

    @classmethod
    def derive(
        cls,
        *,
        model: str,
        revision: str,
        quantization: str,
        text_config: Mapping[str, Any],
        max_model_len: int,
        rope_types_applied: Iterable[str] = (),
        weights: str | None = None,
    ) -> ModelSource:
        """The source of ``model`` as an engine loaded it: ``text_config`` is its text
        config's ``to_dict()``, ``rope_types_applied`` the RoPE types the engine applies
        beyond those the config names (an override); reads the weights of a local path
        (``weights``, default ``model``: where a user names the model, the files)."""
        kinds = rope_types(text_config) | frozenset(rope_types_applied)
        return cls(
            model=model,
            revision=revision,
            quantization=quantization,
            config_digest=config_digest(text_config),
            weights_digest=weights_digest(model if weights is None else weights),
            rope_max_len=rope_max_len(kinds, max_model_len),
        )

    def fingerprint_fields(self) -> dict[str, Any]:
        """The keyword arguments of ``ModelFingerprint`` these fields fill."""
        return {
            "model": self.model,
            "revision": self.revision,
            "quantization": self.quantization,
            "config_digest": self.config_digest,
            "weights_digest": self.weights_digest,
            "rope_max_len": self.rope_max_len,
        }


def _canonical(value: object, where: str) -> object:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): _canonical(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_canonical(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, Enum):
        return _canonical(value.value, where)
    raise InvalidArgumentError("config", f"{where} is a {type(value).__name__}, not JSON data")


def config_digest(config: Mapping[str, Any]) -> bytes:
    """xxh3-128 of the canonical JSON of ``config`` (a ``to_dict()``), volatile keys dropped."""
    kept = {k: v for k, v in config.items() if k not in VOLATILE_CONFIG_KEYS}
    text = json.dumps(_canonical(kept, "config"), sort_keys=True, separators=(",", ":"))
    return xxhash.xxh3_128_digest(text.encode("utf-8"))


def _types_of(params: object) -> set[str]:
    if not isinstance(params, Mapping) or not params:
        return set()
    if all(isinstance(v, Mapping) for v in params.values()):  # one dict per layer type
        return set().union(*(_types_of(v) for v in params.values()))
    kind = params.get("rope_type", params.get("type", "default"))
    return {str(kind)}


def rope_types(config: Mapping[str, Any]) -> frozenset[str]:
    """The RoPE types a config (``to_dict()``) names, over every layer type ({"default"}
    when it names none)."""
    kinds = _types_of(config.get("rope_parameters")) | _types_of(config.get("rope_scaling"))
    return frozenset(kinds or {"default"})


def rope_max_len(types: Iterable[str], max_model_len: int) -> int:
    """``max_model_len`` when a RoPE type in ``types`` depends on it, else 0."""
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1:
        raise InvalidArgumentError("max_model_len", f"must be an int >= 1, got {max_model_len!r}")
    return 0 if set(types) <= LENGTH_FREE_ROPE_TYPES else max_model_len


def _weight_files(model: str) -> list[tuple[str, str]]:
    if os.path.isfile(model):  # a single-file checkpoint (GGUF)
        return [(os.path.basename(model), model)]
    with os.scandir(model) as entries:
        return sorted(
            (e.name, e.path) for e in entries if e.name.endswith(_WEIGHT_SUFFIXES) and e.is_file()
        )


def _sample(path: str, size: int) -> bytes:
    with open(path, "rb") as f:
        if size <= _HEAD_BYTES + _WINDOWS * _WINDOW_BYTES:
            return f.read()
        parts = [f.read(_HEAD_BYTES)]
        span = size - _HEAD_BYTES - _WINDOW_BYTES
        for i in range(_WINDOWS):
            f.seek(_HEAD_BYTES + span * i // (_WINDOWS - 1))
            parts.append(f.read(_WINDOW_BYTES))
        return b"".join(parts)


def weights_digest(model: str) -> bytes:
    """16-byte digest of a local checkpoint's weight files (b"" for a hub id or a folder
    without weight files); OSError when they cannot be read."""
    if not os.path.exists(model):
        return b""
    files = _weight_files(model)
    if not files:
        return b""
    h = xxhash.xxh3_128()
    for name, path in files:
        size = os.stat(path).st_size
        raw = name.encode("utf-8")
        sample = _sample(path, size)
        h.update(struct.pack("<IQI", len(raw), size, len(sample)))
        h.update(raw)
        h.update(sample)
    return h.digest()
