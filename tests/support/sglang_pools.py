"""SGLang's real KV pools on the CPU: a device pool and host pools over it, built as its
cache controller builds them.

Shared by the SGLang tests (tests/integrations/sglang/conftest.py) and the SGLang bench
(bench/sglang_pages.py); both run in ``.venv-sglang``.
"""

from __future__ import annotations

from tests.support.sglang_cpu import prepare_sglang_import

prepare_sglang_import()

import torch  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402

__all__ = ["cpu_device_pool", "host_pool_over"]


def cpu_device_pool(
    *, tokens: int, page_size: int, layers: int, heads: int, head_dim: int
) -> MHATokenToKVPool:
    """A real bf16 device KV pool of ``tokens`` slots on the CPU."""
    return MHATokenToKVPool(
        size=tokens,
        page_size=page_size,
        dtype=torch.bfloat16,
        head_num=heads,
        head_dim=head_dim,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )


def host_pool_over(
    device: MHATokenToKVPool, layout: str, *, page_size: int, budget_bytes: int
) -> MHATokenToKVPoolHost:
    """A real host pool twice ``device``'s size in ``layout`` (its memory left as allocated).

    SGLang sizes a host pool against the machine's free RAM minus a reserve of several GiB,
    which on a shared machine can be below zero; its own scope books the pool against
    ``budget_bytes`` instead.
    """
    info = device.get_device_pool_infos()[0].buffer_info
    with host_memory_budget_scope(budget_bytes):
        return MHATokenToKVPoolHost(
            info,
            2.0,
            0,
            page_size,
            layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=device.size,
            start_layer=device.start_layer,
            end_layer=device.end_layer,
        )
