"""Every reach into vLLM beyond its public connector base API, in one module.

The connector's halves work on plain values (token ids, block ids, counts); what they
need from vLLM's objects (a ``Request``'s prompt, a ``SchedulerOutput``'s block ids, the
model's geometry in ``VllmConfig``, the served model's modules, the CPU cache writer) is
read here, through one small function each. A vLLM upgrade that renames or moves one of
them is fixed in this file; the rest of the package reads like the connector API it
implements.

This module imports vLLM only inside the functions that need one of its modules (and its
types only for the type checker), so every module of the package can import it where
vLLM is not installed; the unit tests in the main environment hand these functions
stand-ins with the same attributes. It imports nothing else of the package but its
errors and the layout type, so nothing here can form an import cycle.

Sections: engine config (``config.py``, ``blend.py``), requests and scheduler steps
(``scheduler.py``, the facade), KV events, worker set-up (the facade), the CPU cache
writer (the start-up layout check) and the served model's Llama modules
(``blend_loop.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nopecache.integrations.vllm.errors import BlendUnavailableError, UnsupportedLayoutError
from nopecache.integrations.vllm.events import Cleared, Event, Removed

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.models.llama import LlamaAttention, LlamaMLP
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import BlockHash
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from nopecache.integrations.vllm.layout import KVLayout

__all__ = [
    "LlamaModules",
    "ScheduledRequest",
    "allocated_block_ids",
    "architectures",
    "attention_backend_name",
    "attention_layers",
    "block_hashes",
    "cache_block_size",
    "event_extra_keys",
    "extra_keys",
    "final_logits",
    "finished_req_ids",
    "has_extra_inputs",
    "hf_text_config",
    "kv_cache_dtype",
    "kv_events",
    "kv_events_enabled",
    "kv_role",
    "kv_transfer_params",
    "layer_rotary",
    "llama_modules",
    "lora_label",
    "max_model_len",
    "mm_placeholders",
    "model_dtype",
    "model_path",
    "model_revision",
    "model_shape",
    "num_scheduled_tokens",
    "output_projection",
    "parallel_sizes",
    "platform_is_cpu",
    "platform_name",
    "prefix_caching",
    "prompt_embeds",
    "prompt_token_ids",
    "qkv",
    "qkv_rope",
    "quantization",
    "recompute_load_failures",
    "request_id",
    "residual_norm",
    "rope",
    "rope_types",
    "rotate_keys",
    "scheduled_requests",
    "tensor_parallel_rank",
    "text_config_dict",
    "tokenizer",
    "total_kv_heads",
    "total_scheduled_tokens",
    "uses_mla",
    "verify_cpu_layout",
    "worker_metadata",
]


# -- engine config --------------------------------------------------------------------
def parallel_sizes(vllm_config: VllmConfig) -> tuple[int, int]:
    """The engine's (tensor, pipeline) parallel sizes."""
    parallel = vllm_config.parallel_config
    return parallel.tensor_parallel_size, parallel.pipeline_parallel_size


def uses_mla(vllm_config: VllmConfig) -> bool:
    """Whether the model uses multi-head latent attention (one latent cache, no K/V)."""
    return bool(getattr(vllm_config.model_config, "use_mla", False))


def hf_text_config(vllm_config: VllmConfig) -> PretrainedConfig:
    """The transformers config of the model's text part (RoPE, attention variants)."""
    return vllm_config.model_config.hf_text_config


def model_shape(vllm_config: VllmConfig) -> tuple[int, int, int]:
    """Attention layers, KV heads and head size of the model on this rank."""
    model_config, parallel = vllm_config.model_config, vllm_config.parallel_config
    return (
        model_config.get_num_layers(parallel),
        model_config.get_num_kv_heads(parallel),
        model_config.get_head_size(),
    )


def total_kv_heads(vllm_config: VllmConfig) -> int:
    """KV heads of the model over all tensor-parallel ranks."""
    return int(vllm_config.model_config.get_total_num_kv_heads())


def tensor_parallel_rank(vllm_config: VllmConfig) -> int:
    """This worker's tensor-parallel rank (0 without tensor parallelism)."""
    if vllm_config.parallel_config.tensor_parallel_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def model_path(vllm_config: VllmConfig) -> str:
    """The model's path or hub id (``--model``; never the served name, a label)."""
    return str(vllm_config.model_config.model)


def model_revision(vllm_config: VllmConfig) -> str:
    """The commit hash transformers read the config at, else the configured revision."""
    model_config = vllm_config.model_config
    for config in (model_config.hf_config, model_config.hf_text_config):
        commit = getattr(config, "_commit_hash", None)
        if commit:
            return str(commit)
    return str(model_config.revision or "")


def quantization(vllm_config: VllmConfig) -> str:
    """The weights' quantization method as vLLM resolved it ("" unquantized)."""
    return str(vllm_config.model_config.quantization or "")


def max_model_len(vllm_config: VllmConfig) -> int:
    """The longest sequence this engine runs (``max_model_len`` as vLLM resolved it)."""
    return int(vllm_config.model_config.max_model_len)


def text_config_dict(vllm_config: VllmConfig) -> dict[str, Any]:
    """The text config as vLLM loaded it (hf overrides applied), as plain data."""
    return dict(vllm_config.model_config.hf_text_config.to_dict())


def rope_types(vllm_config: VllmConfig) -> list[str]:
    """The RoPE types vLLM builds rotary embeddings from, one per layer type."""
    from vllm.transformers_utils.config import iter_rope_parameters

    config = vllm_config.model_config.hf_text_config
    return [str(p.get("rope_type", "default")) for p in iter_rope_parameters(config)]


def kv_cache_dtype(vllm_config: VllmConfig) -> str | None:
    """``kv_cache_dtype`` as configured (``"auto"``: the model's dtype)."""
    return vllm_config.cache_config.cache_dtype


def model_dtype(vllm_config: VllmConfig) -> object:
    """The model's dtype as vLLM resolved it (a ``torch.dtype`` once the config is built)."""
    return vllm_config.model_config.dtype


def cache_block_size(vllm_config: VllmConfig) -> int:
    """vLLM's KV block size in tokens."""
    return int(vllm_config.cache_config.block_size)


def architectures(vllm_config: VllmConfig) -> list[str]:
    """The model's architecture class names (``["LlamaForCausalLM"]``), possibly empty."""
    return list(getattr(vllm_config.model_config, "architectures", None) or [])


def attention_backend_name(vllm_config: VllmConfig) -> str | None:
    """The attention backend the user forced (``"CPU_ATTN"``), None when vLLM picks."""
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    if backend is None:
        return None
    return str(getattr(backend, "name", backend))


def platform_is_cpu() -> bool:
    """Whether vLLM runs on its CPU platform (the CPU build)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def platform_name() -> str:
    """vLLM's name for the device it runs on."""
    from vllm.platforms import current_platform

    return str(current_platform.device_name)


def recompute_load_failures(transfer: KVTransferConfig) -> bool:
    """Make vLLM recompute blocks whose load failed; True when the policy was changed."""
    if transfer.kv_load_failure_policy == "recompute":
        return False
    transfer.kv_load_failure_policy = "recompute"
    return True


def kv_role(transfer: KVTransferConfig) -> str | None:
    """vLLM's ``kv_role`` (kv_both, kv_producer, kv_consumer; None when unset)."""
    return transfer.kv_role


# -- requests and scheduler steps -----------------------------------------------------
def request_id(request: Request) -> str:
    """The request's id."""
    return request.request_id


def kv_transfer_params(request: Request) -> Mapping[str, Any] | None:
    """The ``kv_transfer_params`` the request arrived with (a P/D proxy's hand-off)."""
    params = getattr(request, "kv_transfer_params", None)
    return params if isinstance(params, Mapping) else None


def prompt_token_ids(request: Request) -> tuple[int, ...]:
    """The request's prompt (empty for a prompt given as embeddings)."""
    return tuple(request.prompt_token_ids or ())


def prompt_embeds(request: Request) -> tuple[torch.Tensor | None, list[bool] | None]:
    """The request's prompt embeddings (None: none) and, for a prompt mixing token ids and
    embeddings, which positions are token ids (None: every position is embedded)."""
    embeds = getattr(request, "prompt_embeds", None)
    mask = getattr(request, "prompt_is_token_ids", None)
    return embeds, None if mask is None else [bool(m) for m in mask]


def has_extra_inputs(request: Request) -> bool:
    """Whether the request has any input beside its token ids that vLLM's block hash
    keys on (an adapter, a cache salt, multimodal items, prompt embeddings)."""
    return bool(
        getattr(request, "lora_request", None)
        or getattr(request, "cache_salt", None)
        or getattr(request, "mm_features", None)
        or getattr(request, "prompt_embeds", None) is not None
    )


def extra_keys(request: Request, start: int, end: int) -> tuple[Any, ...]:
    """The extra keys vLLM's block hash folds in for tokens ``[start, end)`` (its own
    ``generate_block_hash_extra_keys``: tagged tuples such as ``("lora", name, path)``)."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    keys, _ = generate_block_hash_extra_keys(request, start, end, 0)
    return tuple(keys or ())


def mm_placeholders(request: Request) -> list[tuple[int, int, str]]:
    """``(offset, length, identifier)`` of each multimodal item's placeholder in the prompt."""
    return [
        (int(f.mm_position.offset), int(f.mm_position.length), str(f.identifier))
        for f in (getattr(request, "mm_features", None) or ())
    ]


def lora_label(request: Request) -> tuple[int, str] | None:
    """The request's LoRA adapter as vLLM's KV events name it: ``(adapter id, name)``."""
    lora = getattr(request, "lora_request", None)
    if not lora:
        return None
    return int(lora.adapter_id), str(lora.name)


def event_extra_keys(
    request: Request, num_blocks: int, block_size: int
) -> list[tuple[Any, ...] | None] | None:
    """vLLM's KV-event ``extra_keys`` of the request's first ``num_blocks`` blocks (None
    when none has any), in the untagged form vLLM publishes its own."""
    if not has_extra_inputs(request):
        return None
    from vllm.v1.core.kv_cache_utils import to_event_extra_keys

    per_block = [
        extra_keys(request, i * block_size, (i + 1) * block_size) or None for i in range(num_blocks)
    ]
    if not any(per_block):
        return None
    return to_event_extra_keys(per_block)


def block_hashes(request: Request) -> list[BlockHash] | None:
    """vLLM's own list of the request's block hashes (None when it keeps none).

    The live list, not a copy: the scheduler half salts entries of it in place.
    """
    hashes = getattr(request, "block_hashes", None)
    return hashes if isinstance(hashes, list) else None


def allocated_block_ids(blocks: KVCacheBlocks | None) -> list[int]:
    """The block ids vLLM allocated to a request (its one KV cache group)."""
    return list(blocks.get_block_ids()[0]) if blocks is not None else []


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """A request in a step's ``SchedulerOutput``, as the scheduler half tracks it."""

    req_id: str
    block_ids: Sequence[int] | None  # blocks given this step (None: none)
    num_computed_tokens: int  # tokens computed before this step
    replaces_blocks: bool  # block_ids are all its blocks (new or resumed), not an extension


def scheduled_requests(scheduler_output: SchedulerOutput) -> Iterator[ScheduledRequest]:
    """The step's new requests, then its running and resumed ones."""
    for new in scheduler_output.scheduled_new_reqs:
        yield ScheduledRequest(new.req_id, new.block_ids[0], new.num_computed_tokens, True)
    cached = scheduler_output.scheduled_cached_reqs
    resumed: set[str] = getattr(cached, "resumed_req_ids", set())
    for i, req_id in enumerate(cached.req_ids):
        new_ids = cached.new_block_ids[i]
        yield ScheduledRequest(
            req_id,
            None if new_ids is None else new_ids[0],
            cached.num_computed_tokens[i],
            req_id in resumed,
        )


def num_scheduled_tokens(scheduler_output: SchedulerOutput) -> Mapping[str, int]:
    """Tokens each request computes this step."""
    return scheduler_output.num_scheduled_tokens


def total_scheduled_tokens(scheduler_output: SchedulerOutput) -> int:
    """Tokens the step's forward computes, all requests together."""
    return int(scheduler_output.total_num_scheduled_tokens)


def finished_req_ids(scheduler_output: SchedulerOutput) -> set[str]:
    """Requests that finished since the previous step."""
    return scheduler_output.finished_req_ids


def worker_metadata(connector_output: KVConnectorOutput) -> KVConnectorWorkerMetadata | None:
    """The workers' aggregated metadata of a step (None when they sent none)."""
    return getattr(connector_output, "kv_connector_worker_meta", None)


# -- KV events ------------------------------------------------------------------------
def kv_events(events: Iterable[Event], medium: str) -> Iterator[KVCacheEvent]:
    """vLLM's KV events for ``events`` (events.py), in order, under ``medium``.

    Hashes are converted as vLLM converts its own for events (ints when
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), so subscribers match them to vLLM's.
    """
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    for event in events:
        if isinstance(event, Cleared):
            yield AllBlocksCleared()
        elif isinstance(event, Removed):
            gone = [maybe_convert_block_hash(h) for h in event.block_hashes]
            yield BlockRemoved(block_hashes=gone, medium=medium)
        else:
            parent = event.parent
            yield BlockStored(
                block_hashes=[maybe_convert_block_hash(h) for h in event.block_hashes],
                parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
                token_ids=list(event.token_ids),
                block_size=event.block_size,
                lora_id=None if event.lora is None else event.lora[0],
                medium=medium,
                lora_name=None if event.lora is None else event.lora[1],
                extra_keys=None if event.extra_keys is None else list(event.extra_keys),
            )


def kv_events_enabled(vllm_config: VllmConfig) -> bool:
    """Whether vLLM publishes KV events (``kv_events_config.enable_kv_cache_events``)."""
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and config.enable_kv_cache_events)


def prefix_caching(vllm_config: VllmConfig) -> bool:
    """Whether vLLM's own prefix cache is on (it then announces blocks of its own)."""
    return bool(vllm_config.cache_config.enable_prefix_caching)


# -- worker set-up --------------------------------------------------------------------
def attention_layers(vllm_config: VllmConfig, names: Iterable[str]) -> dict[str, nn.Module]:
    """The attention modules vLLM registered under ``names`` (those it has)."""
    context = vllm_config.compilation_config.static_forward_context
    return {name: context[name] for name in names if name in context}


def layer_rotary(model: nn.Module, attention_name: str) -> nn.Module | None:
    """The rotary embedding of the attention layer vLLM registered as ``attention_name``
    (``model.layers.3.self_attn.attn``): its parent module's ``rotary_emb``; None when
    that module has none (the layer does not rotate, as far as the connector can tell)."""
    parent, _, _ = attention_name.rpartition(".")
    try:
        owner = model.get_submodule(parent) if parent else model
    except AttributeError:
        return None
    rotary = getattr(owner, "rotary_emb", None)
    return rotary if isinstance(rotary, nn.Module) else None


def rotate_keys(rotary: nn.Module, positions: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Pre-RoPE K ``[n, kv_heads, head_dim]`` rotated to ``positions`` by vLLM's rotary
    module as the layer's forward calls it (``rotary_emb(positions, q, k)``, flat over
    heads, possibly in place: it is handed copies); ``k`` is left unchanged."""
    n = k.shape[0]
    flat = k.reshape(n, -1)
    _, rotated = rotary(positions, flat.clone(), flat.clone())
    return torch.as_tensor(rotated).reshape(k.shape)


# -- the CPU cache writer -------------------------------------------------------------
def verify_cpu_layout(layout: KVLayout, dtype: torch.dtype) -> None:
    """Check the CPU layout against vLLM's own cache writer for this machine's ISA.

    Writes two blocks' worth of random K/V with vLLM's ``cpu_attn_reshape_and_cache``
    (slots reversed, so block and offset both matter) and reads them back through
    ``layout``; any difference raises UnsupportedLayoutError naming the ISA.
    """
    from vllm._custom_ops import cpu_attn_reshape_and_cache
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    bs, h, d = layout.block_size, layout.num_kv_heads, layout.head_dim
    isa = _get_attn_isa(dtype, bs, d)
    scratch = torch.zeros(2, h, bs, 2 * d, dtype=dtype)
    key_cache, value_cache = scratch.view(2, h, 2 * bs, d).chunk(2, dim=2)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2 * bs, h, d, generator=gen).to(dtype)
    v = torch.randn(2 * bs, h, d, generator=gen).to(dtype)
    slots = torch.arange(2 * bs, dtype=torch.int64).flip(0)
    cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
    got_k, got_v = layout.read(scratch, slots)
    if not (torch.equal(got_k, k) and torch.equal(got_v, v)):
        raise UnsupportedLayoutError(
            f"vLLM's CPU attention ISA {isa!r} ({dtype}, block_size {bs}, head_dim {d}) "
            "does not write the layout the connector knows (K^T then V per page)"
        )


# -- the served model's Llama modules -------------------------------------------------
_ATTENTION_PARTS = ("qkv_proj", "o_proj", "rotary_emb", "q_size", "kv_size", "scaling")


def _sub(owner: nn.Module, name: str) -> Any:
    sub = getattr(owner, name, None)
    if sub is None:
        raise BlendUnavailableError(
            f"{type(owner).__name__} has no {name!r}: not a Llama-family layer layout"
        )
    return sub


@dataclass(frozen=True, slots=True)
class LlamaModules:
    """The modules of a vLLM Llama-family ``*ForCausalLM`` the layer loop calls.

    Typed as Llama's; Mistral's and Qwen2's modules have the same attributes and calls.
    """

    embed_tokens: VocabParallelEmbedding
    input_norms: list[RMSNorm]
    post_norms: list[RMSNorm]
    mlps: list[LlamaMLP]
    attns: list[LlamaAttention]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    weight: torch.Tensor  # the embedding's (dtype and device of the model)


def llama_modules(model: nn.Module) -> LlamaModules:
    """The submodules of ``model``; BlendUnavailableError if its layout is not Llama's."""
    base = _sub(model, "model")
    embed_tokens = _sub(base, "embed_tokens")
    layers = list(_sub(base, "layers"))
    if not layers:
        raise BlendUnavailableError("the model has no decoder layers")
    input_norms = [_sub(layer, "input_layernorm") for layer in layers]
    post_norms = [_sub(layer, "post_attention_layernorm") for layer in layers]
    mlps = [_sub(layer, "mlp") for layer in layers]
    attns = [_sub(layer, "self_attn") for layer in layers]
    for attn in attns:
        for name in _ATTENTION_PARTS:
            _sub(attn, name)
        for forbidden in ("q_norm", "k_norm"):
            if getattr(attn, forbidden, None) is not None:
                raise BlendUnavailableError(f"attention has {forbidden}: not supported")
    first = attns[0]
    return LlamaModules(
        embed_tokens=embed_tokens,
        input_norms=input_norms,
        post_norms=post_norms,
        mlps=mlps,
        attns=attns,
        num_heads=int(first.num_heads),
        num_kv_heads=int(first.num_kv_heads),
        head_dim=int(first.head_dim),
        scaling=float(first.scaling),
        weight=embed_tokens.weight,
    )


def qkv(attn: LlamaAttention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K (pre-RoPE) and V of ``x``, flat over heads (vLLM's fused projection returns
    ``(output, bias)``)."""
    fused, _ = attn.qkv_proj(x)
    q, k, v = fused.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    return q, k, v


def rope(
    attn: LlamaAttention, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Q and K rotated to ``positions`` by the layer's own rotary embedding (which may
    rotate its inputs in place: pass copies of what must survive)."""
    q, k = attn.rotary_emb(positions, q, k)
    return q, k


def qkv_rope(
    attn: LlamaAttention, x: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K (both rotated to ``positions``) and V of ``x``, flat over heads."""
    q, k, v = qkv(attn, x)
    q, k = rope(attn, positions, q, k)
    return q, k, v


def output_projection(attn: LlamaAttention, x: torch.Tensor) -> torch.Tensor:
    """The attention output projection of ``x`` (vLLM's layer returns ``(output, bias)``)."""
    out, _ = attn.o_proj(x)
    return out


def residual_norm(
    norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's RMSNorm with its fused residual add: ``(normed, new residual)``.

    Without a residual (the first layer) the input itself becomes the residual.
    """
    if residual is None:
        return norm(hidden), hidden
    out, residual = norm(hidden, residual)
    return out, residual


def final_logits(
    model: nn.Module, hidden: torch.Tensor, residual: torch.Tensor | None
) -> torch.Tensor:
    """Logits ``[n, vocab]`` of the last decoder layer's stream: the model's final norm
    (fused with the residual add), then its LM head through its logits processor."""
    base = _sub(model, "model")
    normed, _ = residual_norm(_sub(base, "norm"), hidden, residual)
    compute = getattr(model, "compute_logits", None)
    if compute is None:
        raise BlendUnavailableError(f"{type(model).__name__} has no compute_logits")
    logits = compute(normed)
    if logits is None:
        raise BlendUnavailableError("the model computed no logits on this rank")
    return torch.as_tensor(logits)


def tokenizer(vllm_config: VllmConfig) -> Any:
    """vLLM's tokenizer of the served model (None when vLLM skips tokenizer init)."""
    from vllm.tokenizers import cached_tokenizer_from_config

    return cached_tokenizer_from_config(vllm_config.model_config)
