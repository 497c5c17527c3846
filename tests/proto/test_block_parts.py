"""A block encoded in parts: the same bytes as the joined blob, its payload views aliasing
K and V where they lie (nothing copied until a transport sends them)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nopecache.proto.block import StoredForm, decode_block, encode_block, validate
from nopecache.proto.block_parts import encode_block_parts

KEY = bytes(range(16))
FP = b"fingerprint"


def _kv(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randint(0, 0x3F00, (3, 10, 2, 4), generator=g, dtype=torch.int16) for _ in "kv")
    return k.view(torch.bfloat16), v.view(torch.bfloat16)


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_parts_join_to_the_blob_of_encode_block(compression: str) -> None:
    k_all, v_all = _kv(1)
    k, v = k_all[:, 4:7], v_all[:, 4:7]
    ids = [7, 8, 9]
    kwargs = dict(key=KEY, fingerprint=FP, form=StoredForm.NOPE, token_ids=ids)
    parts = encode_block_parts(k=k, v=v, compression=compression, **kwargs)  # type: ignore[arg-type]
    blob = encode_block(k=k, v=v, compression=compression, **kwargs)  # type: ignore[arg-type]
    assert parts.join() == blob
    assert parts.nbytes == len(parts) == len(blob)
    assert b"".join(bytes(p) for p in parts.views()) == blob
    validate(blob)


def test_payload_views_alias_the_token_slice_layer_by_layer() -> None:
    k_all, v_all = _kv(2)
    k, v = k_all[:, 4:7], v_all[:, 4:7]
    parts = encode_block_parts(
        key=KEY, fingerprint=FP, form=StoredForm.NOPE, k=k, v=v, token_ids=[1, 2, 3]
    )
    # One view per layer of K, then of V, each sharing memory with its slice (no copy).
    assert len(parts.payload) == 6
    for i, view in enumerate(parts.payload):
        src = (k if i < 3 else v)[i % 3]
        assert np.shares_memory(np.frombuffer(view, dtype=np.uint8), src.view(torch.int16).numpy())
        assert bytes(view) == src.contiguous().view(torch.uint8).numpy().tobytes()
    out = decode_block(parts.join(), expect_key=KEY, expect_tokens=[1, 2, 3])
    assert out.v is not None
    assert torch.equal(out.k.view(torch.int16), k.view(torch.int16))
    assert torch.equal(out.v.view(torch.int16), v.view(torch.int16))
