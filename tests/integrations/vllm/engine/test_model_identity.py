"""The model fingerprint from real ``VllmConfig``s (built as ``vllm serve`` builds them; no
engine started): two engines that differ in one input of the model's identity never share a
block; two that differ only in the served name do.

"Share" means what a block lookup sees: the same fingerprint digest, so the same prefix and
content keys for the same tokens.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from vllm.engine.arg_utils import EngineArgs

from nopecache.client.fingerprint import ModelFingerprint
from nopecache.client.keys import content_key, prefix_key
from nopecache.client.model_source import weights_digest
from nopecache.integrations.vllm.config import UnsupportedEngineError, model_identity

TOKENS = list(range(100, 132))


def _config(model: str, **engine_args: Any) -> Any:
    args = {"enforce_eager": True, "dtype": "float32", "max_model_len": 2048, **engine_args}
    return EngineArgs(model=model, **args).create_engine_config()


def _fingerprint(model: str, **engine_args: Any) -> ModelFingerprint:
    return model_identity(_config(model, **engine_args)).fingerprint


def _shares(a: ModelFingerprint, b: ModelFingerprint) -> bool:
    keys_a = (prefix_key(a, "", TOKENS, None), content_key(a, "", TOKENS))
    keys_b = (prefix_key(b, "", TOKENS, None), content_key(b, "", TOKENS))
    assert (keys_a == keys_b) == (a.digest() == b.digest())
    return keys_a == keys_b


def _differs_only_in(a: ModelFingerprint, b: ModelFingerprint, *fields: str) -> bool:
    """True when ``a`` and ``b`` differ in every one of ``fields`` and nothing else."""
    return dataclasses.replace(b, **{f: getattr(a, f) for f in fields}) == a and all(
        getattr(a, f) != getattr(b, f) for f in fields
    )


def _folder(tmp: Path, model_dir: str, weights: torch.Tensor | None = None) -> Path:
    """A model folder of links to ``model_dir``'s files; with ``weights``, a (small, real)
    safetensors file of its own instead of the link to SmolLM2's."""
    tmp.mkdir()
    for f in Path(model_dir).iterdir():
        if weights is None or f.name != "model.safetensors":
            (tmp / f.name).symlink_to(f.resolve())
    if weights is not None:
        save_file({"model.embed_tokens.weight": weights}, str(tmp / "model.safetensors"))
    return tmp


@pytest.fixture(scope="module")
def base(model_dir: str) -> ModelFingerprint:
    """SmolLM2 as `vllm serve <folder> --dtype float32 --max-model-len 2048` serves it."""
    return _fingerprint(model_dir)


def test_the_served_name_is_only_a_label(model_dir: str, base: ModelFingerprint) -> None:
    for name in ("assistant", ["other", "alias"]):
        fp = _fingerprint(model_dir, served_model_name=name)
        assert fp == base and _shares(fp, base)
    assert base.model == model_dir and "assistant" not in repr(base)


def test_regression_two_models_under_one_served_name_never_share(
    tmp_path: Path, model_dir: str
) -> None:
    """Finding 3: the fingerprint was the served name, so a fine-tune and its base served
    as "assistant" shared every block (and so did an fp8 engine of the same checkpoint)."""
    tuned = _folder(tmp_path / "tuned", model_dir, weights=torch.ones(4, 4))
    a = _fingerprint(model_dir, served_model_name="assistant")
    b = _fingerprint(str(tuned), served_model_name="assistant")
    assert not _shares(a, b)
    # fp8 weights run in bfloat16 on vLLM's CPU build.
    plain = _fingerprint(model_dir, served_model_name="assistant", dtype="bfloat16")
    fp8 = _fingerprint(
        model_dir, served_model_name="assistant", dtype="bfloat16", quantization="fp8"
    )
    assert not _shares(plain, fp8)


def test_the_model_path_is_in_the_fingerprint(
    tmp_path: Path, model_dir: str, base: ModelFingerprint
) -> None:
    # Links to the same files: same config and weights, another path.
    copy = _fingerprint(str(_folder(tmp_path / "copy", model_dir)))
    assert _differs_only_in(base, copy, "model")
    assert not _shares(base, copy)


def test_weights_replaced_in_place_are_seen(tmp_path: Path, model_dir: str) -> None:
    folder = _folder(tmp_path / "m", model_dir, weights=torch.ones(4, 4))
    before = _fingerprint(str(folder))
    assert before.weights_digest == weights_digest(str(folder)) != b""
    # A fine-tune copied over it: same path, same file name and size, other values.
    save_file(
        {"model.embed_tokens.weight": torch.full((4, 4), 2.0)}, str(folder / "model.safetensors")
    )
    after = _fingerprint(str(folder))
    assert _differs_only_in(before, after, "weights_digest")
    assert not _shares(before, after)


def test_the_revision_is_the_commit_hash_else_the_configured_one(
    model_dir: str, base: ModelFingerprint
) -> None:
    v2 = _fingerprint(model_dir, revision="v2")
    assert v2.revision == "v2" and base.revision == ""
    assert _differs_only_in(base, v2, "revision") and not _shares(base, v2)
    commits = []
    for commit in ("a" * 40, "b" * 40):
        config = _config(model_dir, revision="v2")
        config.model_config.hf_config._commit_hash = commit  # as a hub download sets it
        commits.append(model_identity(config).fingerprint)
    assert [fp.revision for fp in commits] == ["a" * 40, "b" * 40]
    # The commit hash is the revision field's, not the config digest's.
    assert _differs_only_in(commits[0], commits[1], "revision")
    assert not _shares(commits[0], commits[1])


def test_the_quantization_method_is_in_the_fingerprint(model_dir: str) -> None:
    plain = _fingerprint(model_dir, dtype="bfloat16")
    fp8 = _fingerprint(model_dir, dtype="bfloat16", quantization="fp8")
    assert (plain.quantization, fp8.quantization) == ("", "fp8")
    assert _differs_only_in(plain, fp8, "quantization") and not _shares(plain, fp8)


def test_the_kv_dtype_is_the_caches(model_dir: str, base: ModelFingerprint) -> None:
    bf16 = _fingerprint(model_dir, dtype="bfloat16")
    assert (base.dtype, bf16.dtype) == ("float32", "bfloat16")
    assert _differs_only_in(base, bf16, "dtype") and not _shares(base, bf16)
    # Naming the model's own dtype is "auto"; any other KV dtype is refused.
    assert _fingerprint(model_dir, dtype="bfloat16", kv_cache_dtype="bfloat16") == bf16
    for kv in ("bfloat16", "fp8", "fp8_e5m2"):
        with pytest.raises(UnsupportedEngineError, match=f"kv_cache_dtype='{kv}'"):
            _fingerprint(model_dir, kv_cache_dtype=kv)


def test_the_text_config_as_vllm_loaded_it(model_dir: str, base: ModelFingerprint) -> None:
    edited = _fingerprint(model_dir, hf_overrides={"rms_norm_eps": 1e-6})
    assert _differs_only_in(base, edited, "config_digest") and not _shares(base, edited)


_THETA = {"rope_theta": 100000.0}
LENGTH_FREE = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0, **_THETA},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
        **_THETA,
    },
}
LENGTH_BOUND = {
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, **_THETA},
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        **_THETA,
    },
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0] * 32,
        "long_factor": [2.0] * 32,
        "original_max_position_embeddings": 1024,
        **_THETA,
    },
}


def _with_rope(model_dir: str, rope: dict[str, Any] | None, length: int) -> ModelFingerprint:
    overrides = {} if rope is None else {"rope_parameters": rope}
    return _fingerprint(model_dir, max_model_len=length, hf_overrides=overrides)


@pytest.mark.parametrize("kind", sorted(LENGTH_FREE))
def test_engines_differing_in_max_model_len_share_where_rope_ignores_it(
    model_dir: str, kind: str
) -> None:
    short, long = (_with_rope(model_dir, LENGTH_FREE[kind], n) for n in (1024, 2048))
    assert short == long and short.rope_max_len == 0 and _shares(short, long)


@pytest.mark.parametrize("kind", sorted(LENGTH_BOUND))
def test_engines_differing_in_max_model_len_never_share_where_rope_depends_on_it(
    model_dir: str, kind: str
) -> None:
    # LongRoPE's case is the sharpest: vLLM rotates with the long table past 1024 tokens.
    short, long = (_with_rope(model_dir, LENGTH_BOUND[kind], n) for n in (1024, 2048))
    assert (short.rope_max_len, long.rope_max_len) == (1024, 2048)
    assert _differs_only_in(short, long, "rope_max_len") and not _shares(short, long)
    assert _with_rope(model_dir, LENGTH_BOUND[kind], 1024) == short


def test_a_rope_override_that_depends_on_the_length_folds_it_in(model_dir: str) -> None:
    dynamic = LENGTH_BOUND["dynamic"]
    short, long = (
        model_identity(_config(model_dir, max_model_len=n), rope_override=dynamic).fingerprint
        for n in (1024, 2048)
    )
    assert (short.rope_max_len, long.rope_max_len) == (1024, 2048) and not _shares(short, long)
