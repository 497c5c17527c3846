"""Wiring nopecache into a prefill loop: store after prefill, lookup + fetch before it.

Run against a server: ``nopecache-server &`` then ``python examples/engine_loop.py``
(or pass a URL: ``python examples/engine_loop.py nopecache://127.0.0.1:50551``).
Random K/V stand in for the engine's; the shapes are a tiny Llama-like model.
"""

from __future__ import annotations

import sys

import torch

from nopecache.client import CacheClient, ModelFingerprint, PagedKV
from nopecache.kernels import RopeSpec
from nopecache.kernels.reference import rotate_reference
from nopecache.proto.block import StoredForm

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16


def main(url: str = "nopecache://127.0.0.1:50551") -> int:
    """Store a document's KV at position 0, reuse it after a 37-token preamble."""
    rope = RopeSpec.from_hf_config(
        {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "rope_theta": 1e4}
    )
    fingerprint = ModelFingerprint.from_rope_spec(
        model="example/tiny-llama",
        revision="1",
        num_layers=LAYERS,
        num_kv_heads=KV_HEADS,
        dtype=torch.float32,
        form=StoredForm.NOPE,
        rope=rope,
    )
    torch.manual_seed(0)
    document = torch.randint(0, 32000, (300,)).tolist()
    k_nope = torch.randn(LAYERS, len(document), KV_HEADS, HEAD_DIM)
    v = torch.randn(LAYERS, len(document), KV_HEADS, HEAD_DIM)

    with CacheClient(url, fingerprint=fingerprint, rope=rope, v_head_dim=HEAD_DIM) as client:
        # 1. After prefill: hand over the nope K (pre-RoPE) and V at their positions.
        #    `segments` marks where messages/documents start, so a moved one keeps its chunks.
        report = client.store(document, (k_nope, v), positions=0, segments=[0])
        print(f"stored {report.stored} blocks ({report.nbytes} bytes)")

        # 2. Before the next prefill: the same document now follows a 37-token preamble.
        preamble = torch.randint(0, 32000, (37,)).tolist()
        prompt = preamble + document
        plan = client.lookup(prompt, segments=[0, len(preamble)])
        print(f"plan: {plan.prefix_tokens} exact-prefix + {plan.pi_tokens} moved tokens reused")

        # 3. Fetch straight into the engine's paged cache (vLLM layout per layer).
        num_blocks, block_size = 32, 16
        k_cache = [torch.zeros(num_blocks, block_size, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
        v_cache = [torch.zeros(num_blocks, block_size, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
        slots = torch.arange(len(prompt), dtype=torch.int64)
        result = client.fetch(plan, prompt, into=PagedKV(k_cache, v_cache, slots))
        print(f"placed {result.placed_tokens} tokens; prefill these: {list(result.misses)}")

    # The placed K equals RoPE applied to the stored nope K at the new positions.
    want = rotate_reference(k_nope[0], None, len(preamble), rope)
    got = k_cache[0].view(-1, KV_HEADS, HEAD_DIM)[len(preamble) : len(prompt)]
    ok = torch.equal(got, want)
    print(f"K placed at positions {len(preamble)}.. matches RoPE at those positions: {ok}")
    return 0 if ok and result.placed_tokens > 0 else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
