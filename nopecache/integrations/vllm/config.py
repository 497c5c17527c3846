"""The vLLM connector's settings and the model identity it derives from vLLM's own config.

Users configure the connector with ``kv_connector_extra_config`` (a JSON object on
``vllm serve --kv-transfer-config``)::

    key          type   default      meaning
    url          str    (required)   nopecache:// or nopecaches:// URL of the servers
    pi_reuse     str    "off"        "off": exact prefixes only (lossless);
                                     "contiguous": also claim position-independent hits
                                     that tile the prompt right after the exact prefix;
                                     "blend": claim up to the last hit anywhere in the
                                     prompt and run the layer loop (blend.py) for
                                     the misses and the policy's tokens
    recompute_policy
                 str    "first_k"    blend only: a policy factory of policies.py
                                     (none, first_k, deviation, blend, taper, selective,
                                     question: ranked by the question's attention)
    recompute_budget
                 float  0.15         blend only: share of the reused position-independent
                                     token-layers the policy recomputes, in [0, 1]
    namespace    str    ""           salt separating workloads within one tenant; unset,
                                     the url's ``?namespace=`` (the two given and
                                     different: a start-up error naming both)
    load         bool   true         look up and load cached KV
    load_async   bool   true         fetch in the background while vLLM runs other
                                     requests (the request waits in
                                     WAITING_FOR_REMOTE_KVS); false: fetch before the
                                     step's forward. Blend claims always load right
                                     before their forward (their layer loop runs there)
    sync_when_idle
                 bool   true         with load_async: a claim made while the engine holds
                                     no other request loads before the step's forward
                                     instead (nothing runs beside a background load
                                     then, and waiting for it costs the request engine
                                     steps); false: always in the background
    layerwise    bool   false        move KV layer by layer beside the forward: a step's
                                     synchronous loads are written into each layer as
                                     the forward reaches it (vLLM's wait_for_layer_load),
                                     saves copied out as each layer is computed
                                     (save_kv_layer); false: loads placed before the
                                     forward, saves gathered after it (layerwise.py).
                                     Off: slower on a CPU engine (bench/vllm_e2e.py)
    lookup_wait_ms
                 float  2.0          how long vLLM's scheduler waits for a lookup before
                                     answering "not yet" (the request is asked again on
                                     a later step while other requests run); 0: never
                                     wait, every looked-up request costs one step
    save         bool   true         store the KV of every prefilled prompt
    segment_token_ids
                 list   []           token ids that start a segment (e.g. the id of
                                     ``<|im_start|>``): each chat message is then
                                     chunked from its own start, so a message that moves
                                     (history truncated) keeps its keys; without them
                                     content-defined chunks resynchronise only after
                                     the first cut past the move
    rope_override
                 dict   {}           RoPE parameters that replace the model config's
                                     ``rope_parameters`` in the connector's description
                                     (keys and store/fetch rotation), e.g.
                                     {"rope_type": "linear", "factor": 2.0,
                                     "rope_theta": 100000}: for a model whose config
                                     does not state the RoPE it runs. Checked at
                                     start-up against every layer's own rotary
                                     embedding like the config's (rope_check.py): a
                                     mismatch turns position-independent reuse off
    blend_check_share
                 float  0.01         blend only: share of blended requests re-checked in
                                     the background against a full prefill, in [0, 1]
                                     (0: never; quality.py)
    kv_event_medium
                 str    "STORAGE"    the medium of the KV events announcing stored blocks
                                     (events.py: the tier name Dynamo and llm-d map
                                     below the GPU; "shared_storage" for llm-d's weight
                                     of a shared tier)

    handoff_deadline_ms
                 float  5000.0       prefill/decode hand-off (kv_consumer, kv_both): how
                                     long a request that arrives with a producer's
                                     ``kv_transfer_params`` waits for the blocks they
                                     name to land (the request waits, the batch steps);
                                     missing then, the rest is recomputed (pd/)

    kv_head_group
                 int    (a rank's    KV heads per stored block (head_groups.py): every
                        heads)       rank stores and fetches its own heads as blocks of
                                     this many, so engines of different tensor-parallel
                                     sizes share them when they set the same value; it
                                     must divide num_kv_heads / tp of each of them (e.g.
                                     num_kv_heads / the largest TP of the fleet). Unset:
                                     one block per chunk and rank, shared only with
                                     engines of the same TP size

vLLM's own ``kv_role`` sets what the engine does (``ConnectorConfig.from_extra_config``'s
``kv_role``): ``kv_both`` loads and stores; ``kv_producer`` (a prefill engine) stores and
never loads, holds each request's blocks until its store is acknowledged and hands the
stored blocks to the decode engine in ``kv_transfer_params`` (``pd/``); ``kv_consumer`` (a
decode engine) loads and never stores. A key that contradicts the role (``load`` true or a
loading key on a producer, ``save`` true on a consumer) is refused, naming it.

Anything else, a wrong type or a bad value raises :class:`ConnectorConfigError` at
start-up, naming the key. The model fingerprint comes from vLLM's ``VllmConfig``, never
from the user: the model path or hub id (``--model``; the served name is only a label),
the config's commit hash else ``--revision``, ``--quantization``, the text config as vLLM
loaded it (digest), the local weight files (sampled digest), layers, KV heads, head dim,
the KV cache dtype, and the RoPE vLLM applies at this engine's ``max_model_len``
(``client/model_source.py``). Two engines share blocks exactly when all of them match.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import torch

from nopecache.client.config import ClientConfig
from nopecache.client.errors import InvalidArgumentError
from nopecache.client.fingerprint import ModelFingerprint
from nopecache.client.head_groups import HeadGroup, rank_head_groups
from nopecache.client.model_source import ModelSource
from nopecache.integrations.vllm import compat
from nopecache.integrations.vllm.errors import ConnectorConfigError, UnsupportedEngineError
from nopecache.integrations.vllm.events import DEFAULT_MEDIUM
from nopecache.kernels import RopeSpec
from nopecache.proto.block import StoredForm
from nopecache.recompute.policies import (
    DEFAULT_BUDGET,
    DEFAULT_POLICY_NAME,
    POLICY_FACTORIES,
    RecomputePolicy,
    policy_by_name,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = [
    "ConnectorConfig",
    "ConnectorConfigError",
    "KvRole",
    "ModelIdentity",
    "PiReuse",
    "UnsupportedEngineError",
    "model_identity",
]

PiReuse = Literal["off", "contiguous", "blend"]
KvRole = Literal["kv_both", "kv_producer", "kv_consumer"]
KV_ROLES: tuple[str, ...] = ("kv_both", "kv_producer", "kv_consumer")
DEFAULT_HANDOFF_DEADLINE_MS = 5000.0
"""How long a decode request waits for its prefill's blocks by default (a store of a
long prompt over a loaded network takes well under a second; five covers a slow one)."""
# Keys that only make sense on an engine that loads: refused on a kv_producer.
_LOADING_KEYS = (
    "load_async",
    "sync_when_idle",
    "lookup_wait_ms",
    "handoff_deadline_ms",
    "recompute_policy",
    "recompute_budget",
    "blend_check_share",
)
DEFAULT_CHECK_SHARE = 0.01
"""Blended requests re-checked against a full prefill by default: one in a hundred."""
_PI_REUSE: tuple[str, ...] = ("off", "contiguous", "blend")


def _bool(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConnectorConfigError(key, f"must be true or false, got {value!r}")
    return value


def _str(key: str, value: object) -> str:
    if not isinstance(value, str):
        raise ConnectorConfigError(key, f"must be a string, got {value!r}")
    return value


def _token_ids(key: str, value: object) -> frozenset[int]:
    if not isinstance(value, list | tuple) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise ConnectorConfigError(key, f"must be a list of token ids (ints >= 0), got {value!r}")
    return frozenset(value)


def _role(kv_role: str | None, extra: Mapping[str, Any]) -> KvRole:
    """vLLM's ``kv_role``, checked against the keys that contradict it."""
    role = "kv_both" if kv_role is None else kv_role
    if role not in KV_ROLES:
        raise ConnectorConfigError(
            "kv_role", f"must be one of {', '.join(KV_ROLES)}, got {kv_role!r}"
        )
    if role == "kv_producer":
        if extra.get("load", False) is not False:
            raise ConnectorConfigError(
                "load", "kv_role='kv_producer' stores and never loads: remove load or set false"
            )
        if extra.get("pi_reuse", "off") != "off":
            raise ConnectorConfigError(
                "pi_reuse", "kv_role='kv_producer' never loads: remove pi_reuse (or set 'off')"
            )
        for key in _LOADING_KEYS:
            if key in extra:
                raise ConnectorConfigError(key, "kv_role='kv_producer' never loads: remove it")
    if role == "kv_consumer" and extra.get("save", False) is not False:
        raise ConnectorConfigError(
            "save", "kv_role='kv_consumer' loads and never stores: remove save or set false"
        )
    return role  # type: ignore[return-value]  # checked against KV_ROLES


def _namespace(client: ClientConfig, given: object) -> str:
    """The key namespace: the extra config's, else the url's ``?namespace=``.

    The connector passes its namespace on every call, which overrides the client's own:
    taking the url's here keeps a ``?namespace=`` from being silently dropped, and two
    different values are refused rather than one picked.
    """
    if given is None:
        return client.namespace
    namespace = _str("namespace", given)
    if client.namespace and namespace != client.namespace:
        raise ConnectorConfigError(
            "namespace",
            f"{namespace!r} differs from the url's ?namespace={client.namespace!r}; "
            "give one of them, or the same value in both",
        )
    return namespace


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """The connector's validated settings (see the module docstring for each key)."""

    client: ClientConfig
    pi_reuse: PiReuse = "off"
    namespace: str = ""
    load: bool = True
    load_async: bool = True
    sync_when_idle: bool = True
    layerwise: bool = False
    lookup_wait_ms: float = 2.0
    save: bool = True
    segment_token_ids: frozenset[int] = frozenset()
    recompute_policy: str = DEFAULT_POLICY_NAME
    recompute_budget: float = DEFAULT_BUDGET
    kv_event_medium: str = DEFAULT_MEDIUM
    rope_override: Mapping[str, Any] | None = None
    blend_check_share: float = DEFAULT_CHECK_SHARE
    kv_head_group: int | None = None
    role: KvRole = "kv_both"
    handoff_deadline_ms: float = DEFAULT_HANDOFF_DEADLINE_MS

    KEYS = (
        "url",
        "pi_reuse",
        "namespace",
        "load",
        "load_async",
        "sync_when_idle",
        "layerwise",
        "lookup_wait_ms",
        "save",
        "segment_token_ids",
        "recompute_policy",
        "recompute_budget",
        "kv_event_medium",
        "rope_override",
        "blend_check_share",
        "kv_head_group",
        "handoff_deadline_ms",
    )

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, kv_role: str | None = "kv_both"
    ) -> ConnectorConfig:
        """Parse and validate ``kv_connector_extra_config`` for vLLM's ``kv_role``;
        raises ConnectorConfigError naming the key."""
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise ConnectorConfigError("*", f"must be a JSON object, got {type(extra).__name__}")
        role = _role(kv_role, extra)
        for key in extra:
            if key not in cls.KEYS:
                raise ConnectorConfigError(
                    str(key), f"unknown key; the keys are {', '.join(cls.KEYS)}"
                )
        if "url" not in extra:
            raise ConnectorConfigError("url", "is required (e.g. nopecache://127.0.0.1:50551)")
        url = _str("url", extra["url"])
        try:
            client = ClientConfig.from_url(url)
        except InvalidArgumentError as err:
            raise ConnectorConfigError("url", str(err)) from None
        pi_reuse = _str("pi_reuse", extra.get("pi_reuse", "off"))
        if pi_reuse not in _PI_REUSE:
            raise ConnectorConfigError(
                "pi_reuse", f"must be one of {', '.join(_PI_REUSE)}, got {pi_reuse!r}"
            )
        for key in ("recompute_policy", "recompute_budget", "blend_check_share"):
            if key in extra and pi_reuse != "blend":
                raise ConnectorConfigError(
                    key, f'applies to pi_reuse="blend" only (pi_reuse is {pi_reuse!r})'
                )
        policy = _str("recompute_policy", extra.get("recompute_policy", DEFAULT_POLICY_NAME))
        if policy not in POLICY_FACTORIES:
            raise ConnectorConfigError(
                "recompute_policy",
                f"must be one of {', '.join(POLICY_FACTORIES)}, got {policy!r}",
            )
        budget = extra.get("recompute_budget", DEFAULT_BUDGET)
        if (
            isinstance(budget, bool)
            or not isinstance(budget, int | float)
            or not 0.0 <= float(budget) <= 1.0
        ):
            raise ConnectorConfigError(
                "recompute_budget", f"must be a number in [0, 1] (e.g. 0.15), got {budget!r}"
            )
        wait = extra.get("lookup_wait_ms", 2.0)
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0.0 <= wait <= 1e4:
            raise ConnectorConfigError(
                "lookup_wait_ms", f"must be a number of milliseconds in [0, 10000], got {wait!r}"
            )
        share = extra.get("blend_check_share", DEFAULT_CHECK_SHARE)
        if (
            isinstance(share, bool)
            or not isinstance(share, int | float)
            or not 0.0 <= float(share) <= 1.0
        ):
            raise ConnectorConfigError(
                "blend_check_share", f"must be a number in [0, 1] (e.g. 0.01), got {share!r}"
            )
        rope_override = extra.get("rope_override")
        if rope_override is not None and (
            not isinstance(rope_override, Mapping)
            or not rope_override
            or not all(isinstance(k, str) for k in rope_override)
        ):
            raise ConnectorConfigError(
                "rope_override",
                "must be a non-empty object of RoPE parameters (e.g. "
                f'{{"rope_type": "linear", "factor": 2.0}}), got {rope_override!r}',
            )
        medium = _str("kv_event_medium", extra.get("kv_event_medium", DEFAULT_MEDIUM))
        if not medium or not medium.isprintable() or any(c.isspace() for c in medium):
            raise ConnectorConfigError(
                "kv_event_medium", f"must be a tier name such as STORAGE, got {medium!r}"
            )
        group = extra.get("kv_head_group")
        if group is not None and (
            isinstance(group, bool) or not isinstance(group, int) or group < 1
        ):
            raise ConnectorConfigError(
                "kv_head_group", f"must be a number of KV heads >= 1, got {group!r}"
            )
        deadline = extra.get("handoff_deadline_ms", DEFAULT_HANDOFF_DEADLINE_MS)
        if (
            isinstance(deadline, bool)
            or not isinstance(deadline, int | float)
            or not 0.0 <= deadline <= 6e5
        ):
            raise ConnectorConfigError(
                "handoff_deadline_ms",
                f"must be a number of milliseconds in [0, 600000], got {deadline!r}",
            )
        namespace = _namespace(client, extra.get("namespace"))
        return cls(
            client=replace(client, namespace=namespace),
            role=role,
            handoff_deadline_ms=float(deadline),
            kv_head_group=group,
            lookup_wait_ms=float(wait),
            kv_event_medium=medium,
            rope_override=None if rope_override is None else dict(rope_override),
            blend_check_share=float(share),
            pi_reuse=pi_reuse,  # type: ignore[arg-type]  # checked against _PI_REUSE
            recompute_policy=policy,
            recompute_budget=float(budget),
            namespace=namespace,
            load=_bool("load", extra.get("load", role != "kv_producer")),
            load_async=_bool("load_async", extra.get("load_async", True)),
            sync_when_idle=_bool("sync_when_idle", extra.get("sync_when_idle", True)),
            layerwise=_bool("layerwise", extra.get("layerwise", False)),
            save=_bool("save", extra.get("save", role != "kv_consumer")),
            segment_token_ids=_token_ids("segment_token_ids", extra.get("segment_token_ids", [])),
        )

    @property
    def producer(self) -> bool:
        """A prefill engine: stores, holds blocks until stored, hands them off."""
        return self.role == "kv_producer"

    @property
    def blend(self) -> bool:
        """True in blend mode."""
        return self.pi_reuse == "blend"

    def policy(self) -> RecomputePolicy:
        """The recompute policy blend mode runs."""
        return policy_by_name(self.recompute_policy, self.recompute_budget)

    def segments(self, tokens: Sequence[int]) -> list[int] | None:
        """Segment starts of ``tokens`` (None: no segment tokens configured)."""
        if not self.segment_token_ids:
            return None
        return [i for i, t in enumerate(tokens) if t in self.segment_token_ids]


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """What the connector knows about the served model: keys, shapes and block size."""

    fingerprint: ModelFingerprint  # every KV head, ROPE form: vLLM's cache holds post-RoPE K
    rope: RopeSpec
    v_head_dim: int
    block_size: int  # vLLM's KV block size in tokens (prefix blocks are cut at it)
    tp_size: int = 1  # tensor-parallel ranks, each holding num_kv_heads / tp_size heads
    kv_head_group: int | None = None  # KV heads per stored block (None: a rank's)

    def __post_init__(self) -> None:
        try:  # every rank splits alike: rank 0's check covers them all
            self.head_groups(0)
        except InvalidArgumentError as err:
            raise ConnectorConfigError("kv_head_group", str(err)) from None

    @property
    def rank_kv_heads(self) -> int:
        """KV heads one tensor-parallel rank holds (its cache's head count)."""
        return self.num_kv_heads // self.tp_size

    @property
    def group_size(self) -> int:
        """KV heads per stored block."""
        return self.rank_kv_heads if self.kv_head_group is None else self.kv_head_group

    @property
    def lookup_fingerprint(self) -> ModelFingerprint:
        """What the scheduler looks prompts up under: the first head group's (every rank
        of every TP size that shares holds one group starting at a multiple of it)."""
        return self.head_groups(0)[0].fingerprint

    def head_groups(self, tp_rank: int) -> list[HeadGroup]:
        """The head groups rank ``tp_rank`` stores and fetches (head_groups.py)."""
        return rank_head_groups(self.fingerprint, self.group_size, self.tp_size, tp_rank)

    @property
    def num_layers(self) -> int:
        """Attention layers of the model."""
        return self.fingerprint.num_layers

    @property
    def num_kv_heads(self) -> int:
        """KV heads of the model (all ranks together)."""
        return self.fingerprint.num_kv_heads

    @property
    def head_dim(self) -> int:
        """K's head dim."""
        return self.fingerprint.head_dim

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of vLLM's KV cache."""
        return self.fingerprint.torch_dtype


# kv_cache_dtype names of unquantized caches. The KV's values depend on the dtype the
# model computes in as well as on the cache's, so only a cache of the model's own dtype
# (what "auto" picks) is served; fp8 KV and every other quantized cache are refused.
_PLAIN_KV_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _kv_dtype(vllm_config: VllmConfig) -> torch.dtype:
    cache_dtype = compat.kv_cache_dtype(vllm_config)
    dtype = compat.model_dtype(vllm_config)
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedEngineError(f"model dtype {dtype!r} is not a torch.dtype")
    if cache_dtype not in ("auto", None) and _PLAIN_KV_DTYPES.get(cache_dtype) != dtype:
        raise UnsupportedEngineError(
            f"kv_cache_dtype={cache_dtype!r}: the connector stores unquantized KV of the "
            f"model's dtype ({dtype}) only; use kv_cache_dtype='auto'"
        )
    return dtype


def _rope(vllm_config: VllmConfig, override: Mapping[str, Any] | None) -> RopeSpec:
    config = compat.hf_text_config(vllm_config)
    if override is None:
        return RopeSpec.from_hf_config(config)
    try:
        merged = {**config.to_dict(), "rope_scaling": None, "rope_parameters": dict(override)}
        return RopeSpec.from_hf_config(merged)
    except (ValueError, TypeError, KeyError) as err:
        raise ConnectorConfigError("rope_override", str(err)) from None


def _source(vllm_config: VllmConfig, rope: RopeSpec) -> ModelSource:
    model = compat.model_path(vllm_config)
    try:
        return ModelSource.derive(
            model=model,
            revision=compat.model_revision(vllm_config),
            quantization=compat.quantization(vllm_config),
            text_config=compat.text_config_dict(vllm_config),
            max_model_len=compat.max_model_len(vllm_config),
            # What vLLM builds per layer type, and the spec's type (rope_override's).
            rope_types_applied=[rope.scaling_type, *compat.rope_types(vllm_config)],
        )
    except InvalidArgumentError as err:
        raise UnsupportedEngineError(f"cannot identify the model: {err}") from err
    except OSError as err:
        raise UnsupportedEngineError(f"cannot read the weight files of {model}: {err}") from err


def model_identity(
    vllm_config: VllmConfig,
    kv_head_group: int | None = None,
    rope_override: Mapping[str, Any] | None = None,
) -> ModelIdentity:
    """The fingerprint, RoPE spec, block size and head split of the model vLLM serves.

    ``rope_override``: RoPE parameters replacing the config's (``ConnectorConfig``).
    Raises UnsupportedEngineError for what the connector cannot serve: pipeline
    parallelism (each rank would hold some layers), tensor parallelism that replicates
    KV heads (more ranks than KV heads), quantized KV, MLA or models without RoPE; and
    ConnectorConfigError for a ``kv_head_group`` that does not divide a rank's heads.
    """
    tensor_parallel, pipeline_parallel = compat.parallel_sizes(vllm_config)
    if pipeline_parallel != 1:
        raise UnsupportedEngineError(
            f"pipeline_parallel_size={pipeline_parallel}: the connector supports "
            "pipeline_parallel_size=1 only (tensor parallelism is supported)"
        )
    if compat.uses_mla(vllm_config):
        raise UnsupportedEngineError("MLA models are not supported by the vLLM connector yet")
    try:
        rope = _rope(vllm_config, rope_override)
    except ConnectorConfigError:
        raise
    except (ValueError, TypeError, KeyError) as err:
        raise UnsupportedEngineError(f"cannot derive a RoPE spec from the model: {err}") from err
    num_layers, _, head_dim = compat.model_shape(vllm_config)
    num_kv_heads = compat.total_kv_heads(vllm_config)
    if num_kv_heads % tensor_parallel:
        raise UnsupportedEngineError(
            f"tensor_parallel_size={tensor_parallel} does not divide the model's "
            f"{num_kv_heads} KV heads (vLLM would replicate heads across ranks); use a "
            "tensor_parallel_size that divides them"
        )
    if head_dim != rope.head_dim:
        raise UnsupportedEngineError(
            f"head size {head_dim} differs from the RoPE spec's head_dim {rope.head_dim}"
        )
    fingerprint = ModelFingerprint.from_rope_spec(
        **_source(vllm_config, rope).fingerprint_fields(),
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        dtype=_kv_dtype(vllm_config),
        form=StoredForm.ROPE,
        rope=rope,
    )
    return ModelIdentity(
        fingerprint=fingerprint,
        rope=rope,
        v_head_dim=head_dim,
        block_size=compat.cache_block_size(vllm_config),
        tp_size=tensor_parallel,
        kv_head_group=kv_head_group,
    )
