"""Which pages are interchangeable: the model fingerprint of an SGLang host pool.

Two SGLang servers share a page only when its bytes mean the same to both:

- the same model as SGLang loaded it (``ModelSource``, read from SGLang's own
  ``ModelConfig`` by ``compat.model_source``): its path or hub id (``--model-path``; the
  served name is only a label), the commit hash else ``--revision``, ``--quantization``,
  the text config (digest, ``--json-model-override-args`` applied), the local weight files
  (sampled digest) and the context length where the RoPE depends on it;
- the same KV: layers, KV heads of the rank, head dims, the host pool's dtype (the KV cache
  dtype, fp8 included) and the dtype the model computes in;
- the same page: page size, payload byte order (``pages.py``) and the same slice of the
  model (tensor-parallel rank and size; pipeline stage). MLA latents are replicated across
  TP ranks, so an MLA fingerprint leaves the rank out (every rank reads what rank 0 wrote).

All of that goes into a :class:`~nopecache.client.ModelFingerprint` of form
``ENGINE_PAGE``: the source fills its source fields, and its 16-byte digest slot (a RoPE
digest for the client's own forms: SGLang's pages are post-RoPE and never rotated) holds
the xxh3-128 of the engine's layout spelled out. Keys are then
``engine_page_key(fingerprint, namespace, SGLang's page hash)``: a vLLM connector's blocks
of the same model (form ROPE, prefix keys) can never answer for an SGLang page, nor the
other way round.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from nopecache.client.fingerprint import ModelFingerprint, dtype_name
from nopecache.client.model_source import ModelSource
from nopecache.integrations.sglang.pages import PageOrder, PoolGeometry
from nopecache.proto.block import StoredForm

__all__ = ["PageIdentity", "page_fingerprint"]


@dataclass(frozen=True, slots=True)
class PageIdentity:
    """The parallel slice a backend serves (from SGLang's ``HiCacheStorageConfig``)."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    is_mla: bool

    @property
    def writes(self) -> bool:
        """Whether this rank stores pages: every rank for MHA, rank 0 only for MLA."""
        return not self.is_mla or self.tp_rank == 0


def page_fingerprint(
    source: ModelSource,
    model_dtype: str,
    geometry: PoolGeometry,
    identity: PageIdentity,
    order: PageOrder,
) -> ModelFingerprint:
    """The fingerprint of ``geometry``'s pages in byte ``order`` (see the module docstring)."""
    tp = "replicated" if identity.is_mla else f"{identity.tp_rank}/{identity.tp_size}"
    layout = (
        f"engine=sglang-hicache;order={order};page_size={geometry.page_size};"
        f"v_head_dim={geometry.v_head_dim};mla={int(identity.is_mla)};tp={tp};"
        f"pp={identity.pp_rank}/{identity.pp_size};model_dtype={model_dtype}"
    )
    return ModelFingerprint(
        **source.fingerprint_fields(),
        num_layers=geometry.num_layers,
        num_kv_heads=geometry.num_heads,
        head_dim=geometry.head_dim,
        dtype=dtype_name(geometry.dtype),
        form=StoredForm.ENGINE_PAGE,
        rope_digest=xxhash.xxh3_128_digest(layout.encode("ascii")),
    )
