"""Fixtures for the tests that run SGLang's own classes (CPU) in ``.venv-sglang``.

They are collected only where SGLang is importable (``make test-sglang`` runs
``.venv-sglang/bin/python -m pytest tests/integrations/sglang``); the main environment skips
this folder. Host pools are SGLang's real ``MHATokenToKVPoolHost`` over a real
``MHATokenToKVPool`` on the CPU, tiny shapes; servers are real nopecache servers on loopback.
The model is a tiny Llama folder of the pools' shape, described by SGLang's own
``ModelConfig`` (what its scheduler builds from ``--model-path``), handed to the backend as
the factory's ``model_config`` keyword.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.sglang_cpu import prepare_sglang_import

prepare_sglang_import()
pytest.importorskip("sglang", reason="the SGLang tests run in .venv-sglang (make test does)")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

from nopecache.integrations.sglang.backend import NopecacheStorage  # noqa: E402
from tests.support.sglang_pools import (  # noqa: E402
    cpu_device_pool,
    host_pool_over,
    tiny_model_config,
    tiny_model_folder,
)

MODEL = "tiny-sglang-test"
PAGE_SIZE = 4
LAYERS = 3
HEADS = 2
HEAD_DIM = 8
DEVICE_TOKENS = 64  # the host pool holds twice that: 33 pages of 4 tokens
# The budget SGLang books the host pools against (see host_pool_over): these pools need a
# few KiB, the budget is far above that.
HOST_BUDGET_BYTES = 1 << 30

HostFactory = Callable[[str], Any]
BackendFactory = Callable[..., NopecacheStorage]


def extra_config(url: str, **extra: Any) -> dict[str, Any]:
    """SGLang's extra config loading this backend dynamically, plus nopecache's keys."""
    return {
        "backend_name": "nopecache",
        "module_path": "nopecache.integrations.sglang.backend",
        "class_name": "NopecacheStorage",
        "interface_v1": 1,
        "url": url,
        **extra,
    }


def storage_config(
    extra: dict[str, Any], *, layout: str = "page_first", **fields: Any
) -> HiCacheStorageConfig:
    """SGLang's storage config for one rank (tp 0 of 1 unless ``fields`` say otherwise)."""
    values: dict[str, Any] = {
        "tp_rank": 0,
        "tp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "attn_cp_rank": 0,
        "attn_cp_size": 1,
        "is_mla_model": False,
        "enable_storage_metrics": False,
        "is_page_first_layout": layout == "page_first",
        "model_name": MODEL,
        **fields,
    }
    # SGLang parses the command line's JSON: the dict it hands over went through json.
    return HiCacheStorageConfig(extra_config=json.loads(json.dumps(extra)), **values)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama folder of the pools' shape (3 layers, 2 KV heads of 8)."""
    folder = tmp_path_factory.mktemp("models") / "tiny-llama"
    return tiny_model_folder(folder, layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM)


@pytest.fixture(scope="session")
def model_config(tiny_model: Path) -> Any:
    """SGLang's ``ModelConfig`` of ``tiny_model`` (bf16, 2048 tokens of context)."""
    return tiny_model_config(tiny_model)


@pytest.fixture(scope="session")
def device_pool() -> MHATokenToKVPool:
    """One real device KV pool on the CPU (bf16, 3 layers, 2 heads of 8)."""
    return cpu_device_pool(
        tokens=DEVICE_TOKENS, page_size=PAGE_SIZE, layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM
    )


@pytest.fixture
def host_pool(device_pool: MHATokenToKVPool) -> HostFactory:
    """``host_pool(layout)``: a new real host pool over the device pool, zeroed."""

    def make(layout: str) -> MHATokenToKVPoolHost:
        host = host_pool_over(
            device_pool, layout, page_size=PAGE_SIZE, budget_bytes=HOST_BUDGET_BYTES
        )
        host.kv_buffer.zero_()
        return host

    return make


@pytest.fixture
def backends(model_config: Any) -> Iterator[BackendFactory]:
    """``backends(host, extra, model=..., **config_fields)``: a backend built by SGLang's
    dynamic factory for ``host`` (and the ``model`` ModelConfig, default ``model_config``)
    and registered with it, as the cache controller does; all closed after the test."""
    made: list[NopecacheStorage] = []

    def make(
        host: Any, extra: dict[str, Any], model: Any = None, **fields: Any
    ) -> NopecacheStorage:
        config = storage_config(extra, layout=host.layout, **fields)
        backend = StorageBackendFactory.create_backend(
            "dynamic", config, host, model_config=model or model_config
        )
        assert isinstance(backend, NopecacheStorage)
        backend.register_mem_pool_host(host)
        made.append(backend)
        return backend

    yield make
    for b in made:
        b.close()
