"""nopecache: a distributed, position-independent KV cache for LLM inference engines.

Packages (layers point one way; see docs/architecture.md):

    kernels        RoPE math and the fused re-RoPE scatter (Triton, torch reference)
    proto          the wire contract server and client share
    cache_server   the server: tiers, transfer rules, gRPC and bulk codecs
    client         the SDK engines embed
    recompute      engine-agnostic selective recompute (policies and the layer loop)
    integrations   one package per engine: vllm, hf
"""
