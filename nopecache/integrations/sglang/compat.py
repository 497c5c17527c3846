"""Everything that reads SGLang's internals (0.5.23): host pool classes, storage config,
the model config, the start-up LoRA adapters, metrics. The rest of the package sees
only :class:`PoolGeometry`, :class:`PageIdentity`,
:class:`~nopecache.client.model_source.ModelSource` and plain values.
"""

from __future__ import annotations

from typing import Any

import torch

from nopecache.client.errors import InvalidArgumentError
from nopecache.client.model_source import ModelSource
from nopecache.integrations.sglang.config import SGLangConfigError
from nopecache.integrations.sglang.identity import PageIdentity
from nopecache.integrations.sglang.pages import PoolGeometry

__all__ = [
    "model_config",
    "model_source",
    "page_identity",
    "pool_geometry",
    "startup_adapters",
    "storage_metrics",
]


def pool_geometry(pool: Any) -> PoolGeometry:
    """The geometry of SGLang's host pool; ValueError for a pool kind not supported."""
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    # SGLang stores fp8 KV as uint8 and keeps no record in the host pool of which fp8
    # format (e4m3 or e5m2) the bytes are: pages of the two would share keys.
    if getattr(pool, "dtype", None) is torch.uint8:
        raise ValueError(
            "an fp8 KV cache (stored as uint8) is not supported by the nopecache backend: "
            "its host pool does not say which fp8 format its pages hold"
        )
    # Exact classes: subclasses (asymmetric K/V widths, sparse pools) lay pages out otherwise.
    if type(pool) is MHATokenToKVPoolHost:
        return PoolGeometry(
            layout=pool.layout,
            page_size=pool.page_size,
            num_layers=pool.layer_num,
            num_heads=pool.head_num,
            head_dim=pool.head_dim,
            v_head_dim=pool.head_dim,
            dtype=pool.dtype,
            components=(pool.k_buffer, pool.v_buffer),
        )
    if type(pool) is MLATokenToKVPoolHost:
        return PoolGeometry(
            layout=pool.layout,
            page_size=pool.page_size,
            num_layers=pool.layer_num,
            num_heads=1,
            head_dim=pool.kv_cache_dim,
            v_head_dim=0,
            dtype=pool.dtype,
            components=(pool.kv_buffer,),
        )
    raise ValueError(
        f"host pool {type(pool).__name__} is not supported by the nopecache backend "
        "(supported: MHATokenToKVPoolHost, MLATokenToKVPoolHost)"
    )


def page_identity(storage_config: Any) -> PageIdentity:
    """The rank slice of SGLang's ``HiCacheStorageConfig``."""
    return PageIdentity(
        tp_rank=int(storage_config.tp_rank),
        tp_size=int(storage_config.tp_size),
        pp_rank=int(storage_config.pp_rank),
        pp_size=int(storage_config.pp_size),
        is_mla=bool(storage_config.is_mla_model),
    )


def model_config(kwargs: Any) -> Any:
    """SGLang's ``ModelConfig`` of the served model: the factory's ``model_config`` keyword
    when given, else built from the server args SGLang published, as its scheduler builds
    it. SGLangConfigError when neither exists (no SGLang server in this process)."""
    given = kwargs.get("model_config") if isinstance(kwargs, dict) else None
    if given is not None:
        return given
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.runtime_context import get_server_args

    try:
        server_args = get_server_args()
    except ValueError:
        raise SGLangConfigError(
            "model",
            "cannot be identified: SGLang published no server args (the backend runs "
            "inside an SGLang server, or is given model_config= by its factory)",
        ) from None
    return ModelConfig.from_server_args(server_args)


def _revision(config: Any) -> str:
    for hf in (config.hf_config, config.hf_text_config):
        commit = getattr(hf, "_commit_hash", None)
        if commit:
            return str(commit)
    return str(config.revision or "")


def _text_config(config: Any) -> dict[str, Any]:
    text = dict(config.hf_text_config.to_dict())
    # SGLang writes its --context-length into the config it loaded: a setting of this
    # server, not of the model. It counts where the RoPE depends on it (rope_max_len).
    text.pop("context_len", None)
    return text


def model_source(config: Any, model: str | None) -> ModelSource:
    """What SGLang loaded (``ModelConfig``): its path (or ``model``, the user's name for
    it), commit hash else revision, quantization, text config, weights, context length."""
    path = str(config.model_path)
    try:
        return ModelSource.derive(
            model=model or path,
            revision=_revision(config),
            quantization=str(config.quantization or ""),
            text_config=_text_config(config),
            max_model_len=int(config.context_len),
            weights=path,
        )
    except InvalidArgumentError as err:
        raise SGLangConfigError("model", f"cannot be identified: {err}") from err
    except OSError as err:
        raise SGLangConfigError("model", f"weights of {path} cannot be read: {err}") from err


def model_dtype(config: Any) -> str:
    """The dtype SGLang computes the model in (``"bfloat16"``)."""
    return str(config.dtype).removeprefix("torch.")


def startup_adapters() -> list[tuple[str, str]]:
    """``(name, path)`` of the LoRA adapters SGLang loads at start-up (``--lora-paths``), from
    the configuration its launcher published in this process; [] when LoRA is off or none
    is published (a backend built outside a server)."""
    from sglang.srt.lora.lora_registry import LoRARef
    from sglang.srt.runtime_context import get_lora

    try:
        lora = get_lora()
        enabled, paths = lora.enable_lora, lora.lora_paths
    except ValueError:  # "config namespace 'lora' not published"
        return []
    # SGLang's rule (arg_groups/lora_hook.py): unset means on when paths are given.
    if not paths or not (enabled or enabled is None):
        return []
    entries = list(paths.items()) if isinstance(paths, dict) else list(paths)
    adapters: list[tuple[str, str]] = []
    for entry in entries:
        if isinstance(entry, LoRARef):
            adapters.append((str(entry.lora_name), str(entry.lora_path)))
        elif isinstance(entry, tuple):
            adapters.append((str(entry[0]), str(entry[1])))
        elif isinstance(entry, dict):
            adapters.append((str(entry["lora_name"]), str(entry["lora_path"])))
        elif isinstance(entry, str):
            name, sep, path = entry.partition("=")
            adapters.append((name, path) if sep else (entry, entry))
        else:
            raise ValueError(f"--lora-paths entry {entry!r} is not one SGLang 0.5.23 accepts")
    return adapters


def storage_metrics(
    prefetch_pages: list[int],
    backup_pages: list[int],
    prefetch_gbps: list[float],
    backup_gbps: list[float],
) -> Any:
    """SGLang's ``StorageMetrics`` record (what ``get_stats`` returns to its collector)."""
    from sglang.srt.observability.metrics_collector import StorageMetrics

    metrics = StorageMetrics()
    metrics.prefetch_pgs.extend(prefetch_pages)
    metrics.backup_pgs.extend(backup_pages)
    metrics.prefetch_bandwidth.extend(prefetch_gbps)
    metrics.backup_bandwidth.extend(backup_gbps)
    return metrics
