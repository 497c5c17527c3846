"""Argument checks of the client's public calls: a typed exception naming the field, raised
before anything is sent (see errors.py)."""

from __future__ import annotations

import torch

from nopecache.client.chunking import TokenArray, TokenIds, token_array
from nopecache.client.errors import FingerprintMismatchError, InvalidArgumentError
from nopecache.client.fingerprint import ModelFingerprint
from nopecache.client.placement import PagedKV
from nopecache.client.plan import ReusePlan
from nopecache.kernels import RopeSpec
from nopecache.kernels.api import Positions
from nopecache.proto.block import StoredForm

__all__ = ["check_fetch", "check_into", "check_kv", "check_model", "check_positions"]


def check_into(
    into: PagedKV | None, fp: ModelFingerprint, v_head_dim: int, num_tokens: int
) -> None:
    """Raise unless ``into`` (if given) is a paged cache of this model for ``num_tokens``."""
    if into is None:
        return
    if not isinstance(into, PagedKV):
        raise InvalidArgumentError("into", f"must be a PagedKV or None, got {type(into).__name__}")
    got = (into.num_layers, into.num_kv_heads, into.head_dim, into.v_head_dim)
    want = (fp.num_layers, fp.num_kv_heads, fp.head_dim, v_head_dim)
    if got != want or into.dtype != fp.torch_dtype:
        raise FingerprintMismatchError(
            f"into: caches of (layers, kv_heads, head_dim, v_head_dim) {got} {into.dtype}, "
            f"the model has {want} {fp.torch_dtype}"
        )
    if into.slot_mapping.numel() != num_tokens:
        raise InvalidArgumentError(
            "into.slot_mapping", f"{into.slot_mapping.numel()} slots for {num_tokens} tokens"
        )


def check_fetch(
    plan: ReusePlan,
    tokens: TokenIds,
    into: PagedKV | None,
    fp: ModelFingerprint,
    v_head_dim: int,
) -> TokenArray:
    """The prompt of a fetch as a token array, checked against its plan and target."""
    if not isinstance(plan, ReusePlan):
        raise InvalidArgumentError("plan", f"must be a ReusePlan, got {type(plan).__name__}")
    arr = token_array(tokens)
    if len(arr) != plan.num_tokens:
        raise InvalidArgumentError(
            "tokens", f"{len(arr)} tokens, the plan is for {plan.num_tokens}"
        )
    check_into(into, fp, v_head_dim, plan.num_tokens)
    return arr


def check_model(fingerprint: ModelFingerprint, rope: RopeSpec, v_head_dim: int) -> None:
    """Raise unless fingerprint, RoPE spec and V head dim describe one model."""
    if not isinstance(fingerprint, ModelFingerprint):
        raise InvalidArgumentError(
            "fingerprint", f"must be a ModelFingerprint, got {type(fingerprint).__name__}"
        )
    if not isinstance(rope, RopeSpec):
        raise InvalidArgumentError("rope", f"must be a RopeSpec, got {type(rope).__name__}")
    if rope.digest() != fingerprint.rope_digest or rope.head_dim != fingerprint.head_dim:
        raise FingerprintMismatchError(
            "rope: this RopeSpec is not the one the fingerprint was made from"
        )
    if isinstance(v_head_dim, bool) or not isinstance(v_head_dim, int) or v_head_dim < 0:
        raise InvalidArgumentError("v_head_dim", f"must be an int >= 0, got {v_head_dim!r}")
    if (v_head_dim == 0) != (fingerprint.form == StoredForm.MLA):
        raise InvalidArgumentError(
            "v_head_dim",
            f"must be 0 exactly for MLA models, got {v_head_dim} for {fingerprint.form.name}",
        )


def check_kv(
    kv: tuple[torch.Tensor, torch.Tensor | None],
    fp: ModelFingerprint,
    v_head_dim: int,
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The (K, V) of a store, checked against the model's shapes and dtype."""
    if not isinstance(kv, tuple | list) or len(kv) != 2:
        raise InvalidArgumentError("kv", "must be a (k, v) pair")
    k, v = kv
    want = (fp.num_layers, num_tokens, fp.num_kv_heads)
    for name, t, dim in (("k", k, fp.head_dim), ("v", v, v_head_dim)):
        if name == "v" and v_head_dim == 0:
            if t is not None:
                raise InvalidArgumentError("kv", "v must be None for MLA (the latent holds it)")
            continue
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise InvalidArgumentError(
                f"kv.{name}", f"must be a 4-D tensor [layers, tokens, kv_heads, dim], got {t!r:.60}"
            )
        if t.shape[1] != num_tokens:
            raise InvalidArgumentError(
                f"kv.{name}", f"{t.shape[1]} tokens, but {num_tokens} token ids were given"
            )
        if t.dtype != fp.torch_dtype or tuple(t.shape) != (*want, dim):
            raise FingerprintMismatchError(
                f"kv.{name}: {t.dtype} {list(t.shape)}, the model's is {fp.torch_dtype} "
                f"{[*want, dim]}"
            )
    return k, v


def check_positions(positions: Positions, num_tokens: int) -> Positions:
    """The positions of a store: an int start >= 0 or one int tensor entry per token."""
    if isinstance(positions, bool) or not isinstance(positions, int | torch.Tensor):
        raise InvalidArgumentError(
            "positions", f"must be an int start or a 1-D int tensor, got {positions!r:.60}"
        )
    if isinstance(positions, int):
        if positions < 0:
            raise InvalidArgumentError("positions", f"must be >= 0, got {positions}")
        return positions
    if positions.dtype not in (torch.int32, torch.int64) or positions.shape != (num_tokens,):
        raise InvalidArgumentError(
            "positions",
            f"must be int32/int64 of shape ({num_tokens},), got {positions.dtype} "
            f"{list(positions.shape)}",
        )
    if num_tokens and int(positions.min()) < 0:
        raise InvalidArgumentError("positions", "must all be >= 0")
    return positions
