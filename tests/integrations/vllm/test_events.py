"""KV events for routers (events.py): what is announced, with which parent, and when it is
withdrawn; the last test follows a real server's removal feed from the scheduler half."""

from __future__ import annotations

import time
from typing import Any, cast

import grpc

from nopecache.client.config import ClientConfig
from nopecache.client.removals import Removal, RemovalFollower
from nopecache.integrations.vllm.config import ConnectorConfig
from nopecache.integrations.vllm.errors import ConnectorConfigError
from nopecache.integrations.vllm.events import AnnouncedBlocks, Cleared, Removed, StoredRun
from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from tests.support.server_procs import CacheServerProc
from tests.support.vllm_halves import BS, _Engine, _request

H = [cast(Any, f"h{i}".encode()) for i in range(6)]  # vLLM block hashes (bytes)
K = [bytes([i]) * 16 for i in range(6)]  # their cache keys
TOKENS = list(range(100, 124))  # 6 blocks of 4


def test_a_longer_prompt_announces_only_its_new_blocks_with_their_parent() -> None:
    blocks = AnnouncedBlocks(clear_all=False)
    blocks.stored(H[:2], K[:2], TOKENS[:8], 4)
    blocks.stored(H[:2], K[:2], TOKENS[:8], 4)  # nothing new
    blocks.stored(H[:4], K[:4], TOKENS[:16], 4)
    assert blocks.take() == [
        StoredRun((H[0], H[1]), None, tuple(TOKENS[:8]), 4),
        StoredRun((H[2], H[3]), H[1], tuple(TOKENS[8:16]), 4),
    ]
    assert blocks.take() == []
    assert len(blocks) == 4


def test_removed_keys_withdraw_their_blocks_in_order() -> None:
    blocks = AnnouncedBlocks(clear_all=False)
    blocks.stored(H[:3], K[:3], TOKENS[:12], 4)
    blocks.on_removal("s", Removal(keys=(K[1], b"\xff" * 16)))  # an unknown key is ignored
    blocks.gone_hashes([H[2], H[5]])
    blocks.stored(H[:2], K[:2], TOKENS[:8], 4)  # block 1 stored again: announced again
    assert blocks.take() == [
        StoredRun(tuple(H[:3]), None, tuple(TOKENS[:12]), 4),
        Removed((H[1], H[2])),
        StoredRun((H[1],), H[0], tuple(TOKENS[4:8]), 4),
    ]


def test_a_flush_clears_all_unless_the_engine_announces_its_own_blocks() -> None:
    only_ours = AnnouncedBlocks(clear_all=True)
    only_ours.stored(H[:2], K[:2], TOKENS[:8], 4)
    only_ours.take()
    only_ours.on_removal("s", Removal(cleared=True))
    assert only_ours.take() == [Cleared()]
    assert len(only_ours) == 0
    # vLLM's prefix cache announces GPU blocks too: a flush must not clear those.
    beside_vllm = AnnouncedBlocks(clear_all=False)
    beside_vllm.stored(H[:2], K[:2], TOKENS[:8], 4)
    beside_vllm.take()
    beside_vllm.on_removal("s", Removal(cleared=True))
    assert beside_vllm.take() == [Removed((H[0], H[1]))]


def test_lost_events_and_a_reset_withdraw_everything() -> None:
    blocks = AnnouncedBlocks(clear_all=True)
    blocks.stored(H[:2], K[:2], TOKENS[:8], 4)
    blocks.take()
    blocks.on_removal("s", Removal(lost=True))  # any key may be gone: never AllBlocksCleared
    assert blocks.take() == [Removed((H[0], H[1]))]
    blocks.stored(H[:1], K[:1], TOKENS[:4], 4)
    blocks.reset()
    assert blocks.take() == [StoredRun((H[0],), None, tuple(TOKENS[:4]), 4), Removed((H[0],))]


def test_the_medium_is_configurable_and_checked() -> None:
    url = "nopecache://127.0.0.1:1"
    assert ConnectorConfig.from_extra_config({"url": url}).kv_event_medium == "STORAGE"
    shared = ConnectorConfig.from_extra_config({"url": url, "kv_event_medium": "shared_storage"})
    assert shared.kv_event_medium == "shared_storage"
    for bad in ("", "two words", 3):
        try:
            ConnectorConfig.from_extra_config({"url": url, "kv_event_medium": bad})
        except ConnectorConfigError as err:
            assert "kv_event_medium" in str(err)
        else:
            raise AssertionError(f"{bad!r} accepted")


def test_blocks_deleted_on_the_server_are_withdrawn(cache_server: CacheServerProc) -> None:
    engine = _Engine(cache_server, 1)
    announced = engine.scheduler.announced
    config = ClientConfig.from_url(f"nopecache://{cache_server.address}")
    follower = RemovalFollower(config, announced.on_removal).start()
    try:
        assert follower.wait_open(60.0)  # a hang guard: milliseconds when idle
        prompt = list(range(100, 114))  # 3 whole blocks
        engine.step(_request("r1", prompt), [3, 0, 2, 1], 0)
        (stored,) = announced.take()
        assert isinstance(stored, StoredRun) and len(stored.block_hashes) == 3
        keys = engine.scheduler.block_keys(prompt[: 3 * BS])
        with grpc.insecure_channel(cache_server.address) as channel:
            stub = cache_pb2_grpc.KVCacheStub(channel)
            stub.Delete(pb.DeleteRequest(keys=keys[1]), timeout=30)
        deadline = time.monotonic() + 60.0  # a hang guard, as above
        events: list[object] = []
        while not events and time.monotonic() < deadline:
            events = list(announced.take())
            time.sleep(0.01)
        assert events == [Removed((stored.block_hashes[1],))]
    finally:
        follower.close()
        engine.close()
