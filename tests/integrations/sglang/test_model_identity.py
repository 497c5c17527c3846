"""The page fingerprint from SGLang's own ``ModelConfig`` and host pools: two servers that
differ in one input of the model's identity never share a page; two that differ only in
the name SGLang hands the backend do.

Every backend is built by SGLang's dynamic factory and registered with a real host pool
(no server is contacted). "Share" means the same fingerprint digest, so the same
``engine_page_key`` for the same page hash.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from sglang.srt.mem_cache.storage import StorageBackendFactory

from nopecache.client.fingerprint import ModelFingerprint
from nopecache.client.keys import engine_page_key
from nopecache.integrations.sglang.config import SGLangConfigError
from tests.integrations.sglang.conftest import (
    DEVICE_TOKENS,
    HEAD_DIM,
    HEADS,
    HOST_BUDGET_BYTES,
    LAYERS,
    PAGE_SIZE,
    BackendFactory,
    HostFactory,
    extra_config,
    storage_config,
)
from tests.support.sglang_pools import (
    cpu_device_pool,
    host_pool_over,
    tiny_model_config,
    tiny_model_folder,
)

URL = "nopecache://127.0.0.1:1"  # nothing listens: building a backend contacts no server
PAGE_HASH = "0f" * 32


def _shares(a: ModelFingerprint, b: ModelFingerprint) -> bool:
    same_key = engine_page_key(a, "", PAGE_HASH) == engine_page_key(b, "", PAGE_HASH)
    assert same_key == (a.digest() == b.digest())
    return same_key


def _differs_only_in(a: ModelFingerprint, b: ModelFingerprint, *fields: str) -> bool:
    """True when ``a`` and ``b`` differ in every one of ``fields`` and nothing else."""
    return dataclasses.replace(b, **{f: getattr(a, f) for f in fields}) == a and all(
        getattr(a, f) != getattr(b, f) for f in fields
    )


@pytest.fixture
def fingerprint(backends: BackendFactory, host_pool: HostFactory) -> Any:
    """``fingerprint(model_config, host=None, extra=None, **storage_fields)``: the
    token-major page fingerprint of a backend SGLang builds for that model."""

    def make(model: Any, host: Any = None, extra: Any = None, **fields: Any) -> ModelFingerprint:
        backend = backends(
            host or host_pool("page_first"), extra or extra_config(URL), model, **fields
        )
        return backend.fingerprint("token_major")

    return make


def _folder(tmp: Path, **config: Any) -> Path:
    return tiny_model_folder(tmp, layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, **config)


def test_the_name_sglang_hands_over_is_only_a_label(fingerprint: Any, model_config: Any) -> None:
    a = fingerprint(model_config, model_name="assistant")
    b = fingerprint(model_config, model_name="another-alias")
    assert a == b and _shares(a, b)
    assert a.model == str(model_config.model_path)


def test_regression_two_models_under_one_name_never_share(
    tmp_path: Path, fingerprint: Any, model_config: Any
) -> None:
    """Finding 3: the backend identified the model by SGLang's name alone, so a fine-tune
    and its base, or an fp8 server beside an unquantized one, shared every page."""
    tuned = _folder(tmp_path / "tuned")
    save_file({"model.embed_tokens.weight": torch.ones(8, 8)}, str(tuned / "model.safetensors"))
    base = fingerprint(model_config, model_name="assistant")
    assert not _shares(base, fingerprint(tiny_model_config(tuned), model_name="assistant"))
    fp8 = tiny_model_config(Path(model_config.model_path), quantization="fp8")
    assert not _shares(base, fingerprint(fp8, model_name="assistant"))


def test_the_model_path_is_in_the_fingerprint(
    tmp_path: Path, fingerprint: Any, model_config: Any, tiny_model: Path
) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model, copy)
    base, moved = fingerprint(model_config), fingerprint(tiny_model_config(copy))
    assert _differs_only_in(base, moved, "model") and not _shares(base, moved)
    # The user's name for the model replaces the path: the copies then share.
    named = extra_config(URL, model="tiny-llama")
    assert _shares(
        fingerprint(model_config, extra=named), fingerprint(tiny_model_config(copy), extra=named)
    )


def test_weights_replaced_in_place_are_seen(tmp_path: Path, fingerprint: Any) -> None:
    folder = _folder(tmp_path / "m")
    before = fingerprint(tiny_model_config(folder))
    save_file({"model.embed_tokens.weight": torch.ones(8, 8)}, str(folder / "model.safetensors"))
    after = fingerprint(tiny_model_config(folder))
    assert _differs_only_in(before, after, "weights_digest") and not _shares(before, after)


def test_the_revision_is_the_commit_hash_else_the_configured_one(
    fingerprint: Any, model_config: Any, tiny_model: Path
) -> None:
    base = fingerprint(model_config)
    v2 = fingerprint(tiny_model_config(tiny_model, revision="v2"))
    assert (base.revision, v2.revision) == ("", "v2")
    assert _differs_only_in(base, v2, "revision") and not _shares(base, v2)
    commits = []
    for commit in ("a" * 40, "b" * 40):
        config = tiny_model_config(tiny_model, revision="v2")
        config.hf_config._commit_hash = commit  # as a hub download sets it
        commits.append(fingerprint(config))
    assert [fp.revision for fp in commits] == ["a" * 40, "b" * 40]
    assert _differs_only_in(commits[0], commits[1], "revision")


def test_the_quantization_method_is_in_the_fingerprint(
    fingerprint: Any, model_config: Any, tiny_model: Path
) -> None:
    base = fingerprint(model_config)
    fp8 = fingerprint(tiny_model_config(tiny_model, quantization="fp8"))
    assert (base.quantization, fp8.quantization) == ("", "fp8")
    assert _differs_only_in(base, fp8, "quantization") and not _shares(base, fp8)


def _host_over(dtype: torch.dtype) -> Any:
    device = cpu_device_pool(
        tokens=DEVICE_TOKENS,
        page_size=PAGE_SIZE,
        layers=LAYERS,
        heads=HEADS,
        head_dim=HEAD_DIM,
        dtype=dtype,
    )
    return host_pool_over(device, "page_first", page_size=PAGE_SIZE, budget_bytes=HOST_BUDGET_BYTES)


def test_the_kv_dtype_and_the_model_dtype_are_in_the_fingerprint(
    fingerprint: Any, model_config: Any, tiny_model: Path
) -> None:
    base = fingerprint(model_config)
    f16 = fingerprint(model_config, host=_host_over(torch.float16))
    assert (base.dtype, f16.dtype) == ("bfloat16", "float16")
    assert _differs_only_in(base, f16, "dtype") and not _shares(base, f16)
    # The same bf16 KV cache, computed by a model running in float16: other values.
    computed = fingerprint(tiny_model_config(tiny_model, dtype="float16"))
    assert _differs_only_in(base, computed, "rope_digest") and not _shares(base, computed)


def test_an_fp8_kv_cache_is_refused(backends: BackendFactory) -> None:
    # SGLang's host pool holds fp8 KV as uint8, without saying e4m3 or e5m2.
    with pytest.raises(ValueError, match=r"fp8 KV cache \(stored as uint8\) is not supported"):
        backends(_host_over(torch.float8_e4m3fn), extra_config(URL))


def test_the_text_config_as_sglang_loaded_it(
    fingerprint: Any, model_config: Any, tiny_model: Path
) -> None:
    base = fingerprint(model_config)
    overrides = json.dumps({"rms_norm_eps": 1e-3})
    edited = fingerprint(tiny_model_config(tiny_model, model_override_args=overrides))
    assert _differs_only_in(base, edited, "config_digest") and not _shares(base, edited)


_THETA = {"rope_theta": 10000.0}
ROPES: dict[str, tuple[dict[str, Any] | None, bool]] = {  # parameters, depends on length
    "default": (None, False),
    "linear": ({"rope_type": "linear", "factor": 2.0, **_THETA}, False),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0, **_THETA}, True),
    "yarn": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, **_THETA},
        True,
    ),
    "longrope": (
        {
            "rope_type": "longrope",
            "short_factor": [1.0] * 4,
            "long_factor": [2.0] * 4,
            "original_max_position_embeddings": 1024,
            **_THETA,
        },
        True,
    ),
}


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_the_context_length_counts_only_where_the_rope_depends_on_it(
    tmp_path: Path, fingerprint: Any, kind: str
) -> None:
    rope, bound = ROPES[kind]
    folder = _folder(tmp_path / kind, **({} if rope is None else {"rope_parameters": rope}))
    short, long = (fingerprint(tiny_model_config(folder, context_length=n)) for n in (1024, 2048))
    if bound:
        assert (short.rope_max_len, long.rope_max_len) == (1024, 2048)
        assert _differs_only_in(short, long, "rope_max_len") and not _shares(short, long)
    else:
        assert short == long and short.rope_max_len == 0 and _shares(short, long)


def test_inside_a_server_the_model_comes_from_sglangs_published_server_args(
    host_pool: HostFactory, fingerprint: Any, model_config: Any, tiny_model: Path
) -> None:
    """What the cache controller does: no model_config keyword; the backend builds SGLang's
    ModelConfig from the server args SGLang publishes, as its scheduler does. Without them
    (no SGLang server in the process) it refuses rather than keying by the name alone."""
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs

    config = storage_config(extra_config(URL))
    if get_context()._server_args is None:  # only this test publishes them
        with pytest.raises(SGLangConfigError, match="'model' cannot be identified"):
            StorageBackendFactory.create_backend("dynamic", config, host_pool("page_first"))
    args = ServerArgs(
        model_path=str(tiny_model),
        served_model_name="alias",
        device="cpu",
        dtype="bfloat16",
        context_length=2048,
    )
    get_context().set_server_args(args)
    backend = StorageBackendFactory.create_backend("dynamic", config, host_pool("page_first"))
    try:
        backend.register_mem_pool_host(host_pool("page_first"))
        assert backend.fingerprint("token_major") == fingerprint(model_config)
    finally:
        backend.close()
