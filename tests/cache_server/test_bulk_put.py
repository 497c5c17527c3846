"""PUT over the bulk byte stream: the same outcomes, limits, verification, quotas and
in-flight budget as a gRPC Put (one code path in the service stores both), and the
client's stores take it by default. Real in-process server on loopback."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import replace

import grpc
import pytest
import torch

from nopecache.client.bulk import BulkSource
from nopecache.proto import cache_pb2 as pb
from nopecache.proto.block import StoredForm, build_block
from nopecache.proto.bulk import BLOCK, ENTRY, ERROR_CODE, PUT_REPLY_CODE, encode_put
from tests.support.bulk_wire import BOUNDED, open_bulk, recv_exact, welcomed
from tests.support.client_harness import client, config, kv, prompt
from tests.support.server_harness import (
    PRESENT,
    REJECTED,
    SMALL,
    STORED,
    get,
    key_of,
    make_block,
    put,
    serving,
)
from tests.support.server_procs import CacheServerProc
from tests.support.waiting import wait_until

INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


def send_put(sock: socket.socket, blocks: list[tuple[bytes, bytes]]) -> None:
    sock.sendall(encode_put(len(blocks)))
    for key, blob in blocks:
        sock.sendall(BLOCK.pack(len(blob), key) + blob)


def read_reply(sock: socket.socket) -> tuple[int, bytes]:
    """(code, body) of the server's answer to a PUT."""
    code, size = ENTRY.unpack(recv_exact(sock, ENTRY.size))
    return code, recv_exact(sock, size)


def outcomes(body: bytes) -> list[tuple[int, int, str]]:
    return [(r.outcome, r.code, r.reason) for r in pb.PutReply.FromString(body).results]


@pytest.mark.asyncio
async def test_a_bulk_put_stores_checks_and_answers_like_a_grpc_put() -> None:
    async with serving(SMALL) as h:
        good, other = key_of(1), key_of(2)
        blob = make_block(good)
        damaged = bytearray(make_block(other))
        damaged[-1] ^= 0xFF  # the payload checksum no longer matches
        sock = await asyncio.to_thread(welcomed, await open_bulk(h))
        with sock:
            await asyncio.to_thread(send_put, sock, [(good, blob), (other, bytes(damaged))])
            first = await asyncio.to_thread(read_reply, sock)
            await asyncio.to_thread(send_put, sock, [(good, blob)])  # same connection again
            second = await asyncio.to_thread(read_reply, sock)
        # The same block over gRPC: the reason a gRPC Put gives, word for word.
        grpc_results = await put(h.stub, [(other, bytes(damaged))], h.frame_bytes)
        lookup = await h.stub.Lookup(pb.LookupRequest(keys=good + other))
    assert first[0] == second[0] == PUT_REPLY_CODE
    [(stored, _, _), (rejected, code, reason)] = outcomes(first[1])
    assert (stored, rejected, code) == (STORED, REJECTED, INVALID)
    # The same check, so the same words (after the block's position in its own stream).
    assert reason.removeprefix("block #1: ") == grpc_results[0].reason.removeprefix("block #0: ")
    assert reason.startswith("block #1: checksum")
    assert outcomes(second[1]) == [(PRESENT, 0, "")]
    assert lookup.tiers == b"\x01\x00"


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("count", "PUT block count: 65 blocks exceeds max_keys_per_request 64"),
        ("size", "PUT block #0: size 1048577 outside (0, max_block_bytes 1048576]"),
        ("empty", "PUT block #0: size 0 outside (0, max_block_bytes 1048576]"),
        (
            "total",
            "PUT block #2: the blocks add up to 3145728 bytes, over max_request_bytes 2097152",
        ),
    ],
)
async def test_a_bulk_put_over_the_limits_is_refused_naming_the_limit(
    case: str, message: str
) -> None:
    async with serving(SMALL) as h:
        reply = await open_bulk(h)

        def attempt() -> tuple[int, bytes]:
            sock = welcomed(reply)
            with sock:
                if case == "count":
                    sock.sendall(encode_put(SMALL.max_keys_per_request + 1))
                elif case == "total":  # three heads of 1 MiB blocks, sent in full
                    sock.sendall(encode_put(3))
                    for i in range(2):
                        sock.sendall(BLOCK.pack(1024 * 1024, key_of(i)) + bytes(1024 * 1024))
                    sock.sendall(BLOCK.pack(1024 * 1024, key_of(2)))
                else:
                    size = SMALL.max_block_bytes + 1 if case == "size" else 0
                    sock.sendall(encode_put(1) + BLOCK.pack(size, key_of(1)))
                got = read_reply(sock)
                assert recv_exact(sock, 1) == b""  # closed after the error
                return got

        code, body = await asyncio.to_thread(attempt)
        lookup = await h.stub.Lookup(pb.LookupRequest(keys=key_of(0) + key_of(1)))
    assert (code, body.decode()) == (ERROR_CODE, message)
    assert lookup.tiers == b"\x00\x00"  # nothing of a refused PUT is stored


@pytest.mark.asyncio
async def test_a_bulk_put_is_charged_to_the_tenant_quota() -> None:
    # Two 4 KiB pages of the CPU tier: two of the three blocks (one page each) fit.
    async with serving(replace(SMALL, tenant_quota=8192)) as h:
        blocks = [(key_of(i), make_block(key_of(i), tokens=64)) for i in range(3)]
        sock = await asyncio.to_thread(welcomed, await open_bulk(h))
        with sock:
            await asyncio.to_thread(send_put, sock, blocks)
            code, body = await asyncio.to_thread(read_reply, sock)
    results = outcomes(body)
    assert code == PUT_REPLY_CODE
    assert [r[:2] for r in results] == [(STORED, 0), (STORED, 0), (REJECTED, EXHAUSTED)]
    assert results[2][2].startswith("block #2: quota: tenant anonymous holds 8192 of its 8192")


@pytest.mark.asyncio
async def test_a_bulk_put_that_stops_sending_is_cut_and_stores_nothing() -> None:
    async with serving(BOUNDED) as h:
        key, blob = key_of(5), make_block(key_of(5), tokens=4000, head_dim=64)
        budget = h.running.service.inflight
        sock = await asyncio.to_thread(welcomed, await open_bulk(h))
        with sock:
            head = encode_put(1) + BLOCK.pack(len(blob), key)
            await asyncio.to_thread(sock.sendall, head + blob[: len(blob) // 2])
            await wait_until(lambda: budget.used_bytes == len(blob))  # reserved while it arrives
            # Holding its block, it owes the minimum rate: silent for the window, it is cut.
            # The window is the default 5 s; 30 s leaves a loaded machine room.
            await wait_until(lambda: budget.used_bytes == 0, timeout_s=30)
            code, body = await asyncio.to_thread(read_reply, sock)
            closed = await asyncio.to_thread(recv_exact, sock, 1)
        lookup = await h.stub.Lookup(pb.LookupRequest(keys=key))
        cut = h.running.metrics.registry.get_sample_value(
            "nopecache_requests_rejected_total", {"method": "Bulk", "reason": "stream_too_slow"}
        )
    assert (code, body.decode()) == (
        ERROR_CODE,
        f"PUT: the client sent nothing for {BOUNDED.min_rate_window_s:g} s (min_rate_window_s), "
        f"below 64KiB/s (min_stream_rate), holding {len(blob)} bytes of the in-flight "
        "budget: the stream is cut and nothing of it is stored",
    )
    assert closed == b"" and lookup.tiers == b"\x00" and cut == 1.0


def test_the_client_stores_over_the_bulk_stream_by_default(cache_server: CacheServerProc) -> None:
    tokens = prompt(80, seed=41)
    k, v = kv(80, seed=41)
    for bulk in ("auto", "off"):
        with client(config([cache_server], f"bulk-put-{bulk}", shm="off", bulk=bulk)) as c:
            report = c.store(tokens, (k, v), form="nope")
            source = c.core.connection(cache_server.address).data_blocks
            plan = c.lookup(tokens)
            result = c.fetch(plan, tokens)
        assert report.failed == 0 and report.stored > 0
        assert result.failed == () and result.v is not None
        assert torch.equal(result.v[:, : plan.prefix_end], v[:, : plan.prefix_end])
        if bulk == "auto":
            assert isinstance(source, BulkSource) and source.bulk_puts == 1
        else:
            assert not isinstance(source, BulkSource)


@pytest.mark.asyncio
async def test_reused_receive_buffers_never_change_what_was_stored() -> None:
    """A PUT's blocks arrive in pooled receive buffers that the next PUT reuses: what the
    first PUT stored stays byte for byte (the tier copied it), a corrupt block of either
    is refused and not stored, and the pool kept the buffers (they were reused)."""
    async with serving(SMALL) as h:
        a, b, c, d = (key_of(i) for i in range(10, 14))
        blob_a, blob_c = make_block(a, tokens=64), make_block(c, tokens=64)
        assert len(blob_a) == len(blob_c)  # one size class: C lands in A's buffer
        damaged_b = bytearray(make_block(b, tokens=64))
        damaged_b[-1] ^= 0xFF
        damaged_d = bytearray(make_block(d, tokens=64))
        damaged_d[len(damaged_d) // 2] ^= 0x01
        bulk = h.running.service.bulk
        sock = await asyncio.to_thread(welcomed, await open_bulk(h))
        assert bulk is not None
        with sock:
            await asyncio.to_thread(send_put, sock, [(a, blob_a), (b, bytes(damaged_b))])
            first = await asyncio.to_thread(read_reply, sock)
            idle_after_first = bulk.receive_buffers.idle_bytes
            await asyncio.to_thread(send_put, sock, [(c, blob_c), (d, bytes(damaged_d))])
            second = await asyncio.to_thread(read_reply, sock)
        blobs, _ = await get(h.stub, [a, b, c, d])
    assert [o for o, _, _ in outcomes(first[1])] == [STORED, REJECTED]
    assert [o for o, _, _ in outcomes(second[1])] == [STORED, REJECTED]
    # Both buffers came back after the first PUT, and were taken again by the second.
    assert idle_after_first == bulk.receive_buffers.idle_bytes == 2 * 1024 * 1024
    assert blobs == [blob_a, None, blob_c, None]


@pytest.mark.asyncio
async def test_a_put_hashed_as_it_lands_is_checked_piece_by_piece(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server hashes a PUT block's payload in pieces as they land and checks that
    digest: a byte flipped in any piece (the first, across a piece boundary, the last) is
    refused and not stored, an intact block is stored byte for byte, and an lz4 block
    (whose checksum covers the decompressed payload, not the bytes received) is checked in
    full as before. Pieces of 100 bytes and a 1-byte thread threshold: every block spans
    several pieces and takes the path of a large one."""
    from nopecache.cache_server import bulk as server_bulk
    from nopecache.cache_server import verify

    monkeypatch.setattr(server_bulk, "HASH_PIECE", 100)
    monkeypatch.setattr(verify, "THREAD_BYTES", 1)
    async with serving(SMALL) as h:
        keys = [key_of(i) for i in range(20, 25)]
        blobs = [bytearray(make_block(k, tokens=16)) for k in keys[:4]]
        payload = len(blobs[0]) - 2 * 16 * 8 * 2
        for blob, at in zip(blobs[1:4], (0, 99, 2 * 16 * 8 * 2 - 1), strict=True):
            blob[payload + at] ^= 0x04
        packed = build_block(
            key=keys[4],
            fingerprint=b"test-model",
            form=StoredForm.NOPE,
            dtype="float16",
            shape=(1, 16, 1, 8),
            v_head_dim=8,
            token_ids=list(range(16)),
            payload=bytes(512),  # zeros: lz4 shrinks them
            compression="lz4",
        )
        sent = [bytes(b) for b in blobs] + [packed]
        sock = await asyncio.to_thread(welcomed, await open_bulk(h))
        with sock:
            await asyncio.to_thread(send_put, sock, list(zip(keys, sent, strict=True)))
            reply = await asyncio.to_thread(read_reply, sock)
        stored, _ = await get(h.stub, keys)
    results = outcomes(reply[1])
    assert [o for o, _, _ in results] == [STORED, REJECTED, REJECTED, REJECTED, STORED]
    assert all(
        r.startswith(f"block #{i}: checksum")
        for i, (_, _, r) in enumerate(results)
        if i in (1, 2, 3)
    )
    assert stored == [sent[0], None, None, None, sent[4]]
