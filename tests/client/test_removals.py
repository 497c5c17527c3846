"""RemovalFollower: a client follows a real server's removal feed from a thread, and after
the server restarts it reports that events may have been missed (``lost``)."""

from __future__ import annotations

import queue

import grpc

from nopecache.client.config import ClientConfig
from nopecache.client.removals import Removal, RemovalFollower
from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from tests.support.server_harness import key_of, make_block
from tests.support.server_procs import CacheServerProc

# Hang guards only: a stream opens and an event arrives within milliseconds when idle.
OPEN_TIMEOUT_S = 60.0
EVENT_TIMEOUT_S = 60.0


def _put(address: str, key: bytes) -> None:
    blob = make_block(key)
    with grpc.insecure_channel(address) as channel:
        stub = cache_pb2_grpc.KVCacheStub(channel)
        frames = iter([pb.PutFrame(key=key, total_size=len(blob), data=blob)])
        reply = stub.Put(frames, timeout=30)
        assert [r.outcome for r in reply.results] == [pb.PUT_OUTCOME_STORED]


def _delete(address: str, keys: list[bytes]) -> None:
    with grpc.insecure_channel(address) as channel:
        cache_pb2_grpc.KVCacheStub(channel).Delete(pb.DeleteRequest(keys=b"".join(keys)))


def test_the_follower_hears_deletes_and_a_restart(cache_server: CacheServerProc) -> None:
    heard: queue.Queue[tuple[str, Removal]] = queue.Queue()
    address = cache_server.address
    config = ClientConfig.from_url(f"nopecache://{address}")
    follower = RemovalFollower(config, lambda a, r: heard.put((a, r)), retry_s=0.2).start()
    try:
        assert follower.wait_open(OPEN_TIMEOUT_S)
        keys = [key_of(1), key_of(2)]
        for key in keys:
            _put(address, key)
        _delete(address, keys)
        assert heard.get(timeout=EVENT_TIMEOUT_S) == (address, Removal(keys=tuple(keys)))
        cache_server.kill()
        cache_server.start()  # same port: the follower reconnects
        assert heard.get(timeout=EVENT_TIMEOUT_S) == (address, Removal(lost=True))
        _delete(address, [key_of(3)])
        assert heard.get(timeout=EVENT_TIMEOUT_S) == (address, Removal(keys=(key_of(3),)))
    finally:
        follower.close()
    assert heard.empty()
