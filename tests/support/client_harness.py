"""The tiny model the CacheClient tests store and fetch, for tests: its shapes, RoPE and
fingerprint, a client of it, a config for server processes, and seeded prompts and KV.
"""

from __future__ import annotations

import asyncio

import torch

from nopecache.client import (
    CacheClient,
    ClientConfig,
    ContentChunker,
    ModelFingerprint,
    RetryPolicy,
)
from nopecache.client.cost import CostConfig
from nopecache.client.keys import KeyedChunk, content_chunks
from nopecache.client.transport import ServerConnection
from nopecache.kernels import RopeSpec
from nopecache.proto.block import StoredForm, encode_block
from tests.support.server_procs import CacheServerProc

LAYERS, HEADS, DIM = 2, 2, 8
SPEC = RopeSpec.default(DIM)
CHUNKER = ContentChunker(min_size=4, avg_size=16, max_size=32)
PREFIX_BLOCK = 16


def fingerprint(form: StoredForm, dtype: torch.dtype = torch.float32) -> ModelFingerprint:
    """The tiny test model's fingerprint."""
    return ModelFingerprint.from_rope_spec(
        model="tiny",
        revision="1",
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        dtype=dtype,
        form=form,
        rope=SPEC,
    )


def config(servers: list[CacheServerProc], namespace: str, **changes: object) -> ClientConfig:
    """No retries, cost model off (so plans do not depend on timings), own namespace."""
    fields: dict[str, object] = {
        "retry": RetryPolicy(max_attempts=1),
        "cost": CostConfig(enabled=False),
        "namespace": namespace,
        **changes,
    }
    return ClientConfig(servers=tuple(s.address for s in servers), **fields)  # type: ignore[arg-type]


def client(cfg: ClientConfig, form: StoredForm = StoredForm.NOPE, **kw: object) -> CacheClient:
    """A CacheClient of the tiny model whose prefix blocks are stored in ``form``."""
    return CacheClient(
        cfg,
        fingerprint=fingerprint(form, kw.pop("dtype", torch.float32)),  # type: ignore[arg-type]
        rope=SPEC,
        v_head_dim=DIM,
        prefix_block_tokens=PREFIX_BLOCK,
        chunker=CHUNKER,
        **kw,  # type: ignore[arg-type]
    )


def prompt(n: int, seed: int, low: int = 0) -> torch.Tensor:
    """``n`` random token ids in [low, low + 5000)."""
    return torch.randint(low, low + 5000, (n,), generator=torch.Generator().manual_seed(seed))


def kv(n: int, seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V ``[layers, n, heads, dim]``."""
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, n, HEADS, DIM)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def put_forged_chunk(
    c: CacheClient,
    namespace: str,
    tokens: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    index: int,
) -> KeyedChunk:
    """Put, raw, a block of other tokens (each id + 1) under the key of ``tokens``'s content
    chunk ``index`` (``CHUNKER``, the client's own PI fingerprint): the server cannot tell,
    the client's verification must. Returns that chunk."""
    k, v = kv
    nope_fp = c.core.pi_fingerprint
    victim = content_chunks(nope_fp, namespace, tokens.numpy(), CHUNKER.split(tokens))[index]
    s, e = victim.span.start, victim.span.end
    forged = encode_block(
        key=victim.key.value,
        fingerprint=nope_fp.to_bytes(),
        form=StoredForm.NOPE,
        k=k[:, s:e],
        v=v[:, s:e],
        token_ids=[t + 1 for t in tokens[s:e].tolist()],
    )

    async def put() -> None:
        conn = ServerConnection(c.core.ring.owner(victim.key), c.core.config)
        (result,) = await conn.put([(victim.key.value, forged)])
        await conn.close()
        assert result.ok

    asyncio.run(put())
    return victim
