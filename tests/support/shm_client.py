"""The tiny model of the shared-memory tests, for tests and the child processes they
start: shapes big enough that a prompt fills more than a minimum-size segment, a client
of it, a config for one server process, and the big prompt the server holds.
"""

from __future__ import annotations

import torch

from nopecache.client import CacheClient, ClientConfig, ContentChunker, ModelFingerprint
from nopecache.client import shm as client_shm
from nopecache.client.cost import CostConfig
from nopecache.client.shm import ShmFastPath
from nopecache.kernels import RopeSpec
from nopecache.proto.block import StoredForm
from tests.support.server_procs import CacheServerProc

LAYERS, HEADS, DIM = 2, 2, 128
SPEC = RopeSpec.default(DIM)
FP = ModelFingerprint.from_rope_spec(
    model="tiny-shm",
    revision="1",
    num_layers=LAYERS,
    num_kv_heads=HEADS,
    dtype=torch.float32,
    form=StoredForm.NOPE,
    rope=SPEC,
)
PREFIX_BLOCK = 256  # 1 MiB of K and V per prefix block
BIG_TOKENS = 12 * PREFIX_BLOCK  # 12 MiB: more than a minimum-size (8 MiB) segment
SEGMENT = client_shm.MIN_SEGMENT_BYTES
CHUNKER = ContentChunker(min_size=8, avg_size=32, max_size=64)


def config(
    server: CacheServerProc | str, shm: str = "auto", *, zero_copy: bool = False
) -> ClientConfig:
    """Cost model off (plans do not depend on timings), generous deadlines for 2 busy cores;
    zero copy off by default: these are the segment's tests (test_zero_copy.py has its own)."""
    return ClientConfig(
        servers=(server if isinstance(server, str) else server.address,),
        cost=CostConfig(enabled=False),
        get_timeout_s=30.0,
        put_timeout_s=30.0,
        namespace="shm-tests",
        shm=shm,  # type: ignore[arg-type]
        zero_copy=zero_copy,
    )


def client(cfg: ClientConfig, fast_path: ShmFastPath | None = None) -> CacheClient:
    """A client of the tiny model (explicit fast path, or what ``cfg.shm`` wires in)."""
    return CacheClient(
        cfg,
        fingerprint=FP,
        rope=SPEC,
        v_head_dim=DIM,
        prefix_block_tokens=PREFIX_BLOCK,
        chunker=CHUNKER,
        fast_path=fast_path,
    )


def prompt(n: int, seed: int) -> torch.Tensor:
    """``n`` token ids."""
    return torch.randint(0, 30000, (n,), generator=torch.Generator().manual_seed(seed))


def kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V ``[layers, n, heads, dim]``."""
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, n, HEADS, DIM)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


BIG = prompt(BIG_TOKENS, seed=7)
