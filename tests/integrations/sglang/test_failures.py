"""Failures are misses; bad configuration is refused naming the key; engines never mix.

A dead server (nothing listening) and a hung one (a real listener that accepts and never
answers) must turn every call into a miss within the configured timeouts, never an
exception or None (SGLang's backup thread dies on either).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.storage import StorageBackendFactory

from nopecache.client import CacheClient, ModelFingerprint
from nopecache.client.keys import engine_page_key
from nopecache.integrations.sglang.config import SGLangConfigError
from nopecache.kernels import RopeSpec
from nopecache.proto.block import StoredForm
from tests.integrations.sglang.conftest import (
    HEAD_DIM,
    HEADS,
    LAYERS,
    MODEL,
    BackendFactory,
    HostFactory,
    extra_config,
    storage_config,
)
from tests.integrations.sglang.test_backend import fill, token_slots, url_of
from tests.support.redis_procs import free_ports
from tests.support.server_procs import CacheServerProc, wait_stored

# Every timeout the backend has, short: the calls below must end by them.
FAST = {
    "connect_timeout_s": 0.5,
    "lookup_timeout_s": 0.5,
    "get_timeout_s": 1.0,
    "put_timeout_s": 1.0,
}
# Only a hang guard: the timeouts above add up to a few seconds; on a 2-core machine loaded
# by other suites a call may take several times that. A hang (no timeout at all) is minutes.
HANG_GUARD_S = 30.0


@pytest.fixture
def hung_listener() -> Iterator[str]:
    """A real TCP listener on loopback that accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            held.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    sock.close()


def _every_call_misses(backend: Any) -> None:
    keys = ["a", "b"]
    start = time.monotonic()
    assert backend.batch_set_v1(keys, token_slots([1, 2])) == [False, False]
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, token_slots([3, 4])) == [False, False]
    assert backend.get("a") is None
    assert backend.batch_set(["c"], [backend.mem_pool_host.get_data_page(0)]) is False
    backend.clear()
    assert time.monotonic() - start < HANG_GUARD_S


def test_dead_server_gives_misses(host_pool: HostFactory, backends: BackendFactory) -> None:
    (port,) = free_ports(1)
    host = host_pool("page_first")
    fill(host, seed=11)
    _every_call_misses(backends(host, extra_config(f"nopecache://127.0.0.1:{port}", **FAST)))


def test_hung_server_gives_misses_within_the_timeouts(
    hung_listener: str, host_pool: HostFactory, backends: BackendFactory
) -> None:
    host = host_pool("page_first")
    fill(host, seed=12)
    _every_call_misses(backends(host, extra_config(f"nopecache://{hung_listener}", **FAST)))


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({}, "url"),
        ({"url": ""}, "url"),
        ({"url": "http://127.0.0.1:1"}, "url"),
        ({"url": "nopecache://127.0.0.1:1", "urll": "x"}, "urll"),
        ({"url": "nopecache://127.0.0.1:1", "lookup_timeout_s": -1}, "lookup_timeout_s"),
        ({"url": "nopecache://127.0.0.1:1", "get_timeout_s": "fast"}, "get_timeout_s"),
        ({"url": "nopecache://127.0.0.1:1", "put_timeout_s": True}, "put_timeout_s"),
        ({"url": "nopecache://127.0.0.1:1", "namespace": 7}, "namespace"),
        ({"url": "nopecache://127.0.0.1:1", "token": ["t"]}, "token"),
        ({"url": "nopecache://127.0.0.1:1", "interface_v1": 2}, "interface_v1"),
        ({"url": "nopecache://127.0.0.1:1", "model": ""}, "model"),
        ({"url": "nopecache://127.0.0.1:1?kv_codec=fp8"}, "url"),  # pages take no codec
    ],
)
def test_bad_extra_config_is_refused_naming_the_key(
    host_pool: HostFactory, extra: dict[str, Any], key: str
) -> None:
    full = {**extra_config("unused"), **extra}
    if "url" not in extra:
        del full["url"]
    config = storage_config(full)
    with pytest.raises(SGLangConfigError) as err:
        StorageBackendFactory.create_backend("dynamic", config, host_pool("page_first"))
    assert err.value.key == key
    assert f"{key!r}" in str(err.value)


def test_vllm_connector_blocks_and_sglang_pages_never_meet(
    cache_server: CacheServerProc, host_pool: HostFactory, backends: BackendFactory
) -> None:
    """The same model stored by the vLLM connector's client (post-RoPE prefix blocks) and by
    SGLang (engine pages): different fingerprints, disjoint keys, neither sees the other."""
    rope = RopeSpec.default(HEAD_DIM)
    vllm_fp = ModelFingerprint.from_rope_spec(
        model=MODEL,
        revision="",
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        dtype=torch.bfloat16,
        form=StoredForm.ROPE,
        rope=rope,
    )
    host = host_pool("page_first")
    fill(host, seed=13)
    sglang = backends(host, extra_config(url_of(cache_server)))
    sglang_fp = sglang.fingerprint("token_major")
    assert vllm_fp.to_bytes() != sglang_fp.to_bytes()
    assert vllm_fp.digest() != sglang_fp.digest()

    tokens = list(range(100, 108))
    k = torch.randn(LAYERS, len(tokens), HEADS, HEAD_DIM).to(torch.bfloat16)
    v = torch.randn(LAYERS, len(tokens), HEADS, HEAD_DIM).to(torch.bfloat16)
    url = f"nopecache://{cache_server.address}?shm=off"
    with CacheClient(
        url, fingerprint=vllm_fp, rope=rope, v_head_dim=HEAD_DIM, prefix_block_tokens=4
    ) as vllm_client:
        report = vllm_client.store(tokens, (k, v), 0, form="rope", position_independent=False)
        assert report.stored == 2
        # SGLang's page hashes as text that could even spell the vLLM keys: still misses.
        vllm_keys = [c.key.hex() for c in vllm_client.lookup(tokens).prefix]
        assert len(vllm_keys) == 2
        assert sglang.batch_exists(vllm_keys) == 0
        assert sglang.batch_set_v1(vllm_keys, token_slots([1, 2])) == [True, True]
        assert wait_stored(cache_server.address, at_least=4) == 4
        sglang_keys = {engine_page_key(sglang_fp, "", h) for h in vllm_keys}
        assert not sglang_keys & {c.key for c in vllm_client.lookup(tokens).prefix}
        assert len(vllm_client.lookup(tokens).prefix) == 2
