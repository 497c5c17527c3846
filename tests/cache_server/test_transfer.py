"""The transfer rules called directly, no transport: Put admission and refusals, quota
charging, frame staging, and Get reads (compared with what the gRPC path sends).

Real components: a CPU tier, the server's quota ledger, verifier and in-flight budget.
"""

from __future__ import annotations

import ast
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from nopecache.cache_server.inflight import InflightBudget, Lease
from nopecache.cache_server.main import start_server
from nopecache.cache_server.metrics import ServerMetrics
from nopecache.cache_server.refusal import Refusal, RefusalKind
from nopecache.cache_server.store import PutOutcome, TieredStore
from nopecache.cache_server.tenants import ANONYMOUS, QuotaLedger, Tenant
from nopecache.cache_server.transfer_get import GetRules, SendBuffer
from nopecache.cache_server.transfer_put import (
    BULK_WORDING,
    FRAME_WORDING,
    BlockResult,
    PutRules,
    PutWording,
)
from nopecache.cache_server.verify import BlockVerifier
from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from nopecache.proto.block import StoredForm, build_block
from tests.support.server_harness import SMALL

CONFIG = SMALL  # the in-process harness's small limits: the same rules, no transport
MIB = 1024 * 1024


def key_of(i: int) -> bytes:
    """A distinct 16-byte key."""
    return i.to_bytes(4, "big") * 4


def block(key: bytes) -> bytes:
    """A valid float16 NOPE block for ``key`` (a few hundred bytes, one 4 KiB page)."""
    return build_block(
        key=key,
        fingerprint=b"test-model",
        form=StoredForm.NOPE,
        dtype="float16",
        shape=(1, 4, 1, 8),
        v_head_dim=8,
        token_ids=[0, 1, 2, 3],
        payload=(key * 8)[:128],
    )


@dataclass
class Rules:
    """The rules of one server, built as ``KVCacheService`` builds them."""

    store: TieredStore
    budget: InflightBudget
    puts: PutRules
    gets: GetRules

    def lease(self) -> Lease:
        """A lease of the in-flight budget for one request."""
        return self.budget.lease("client")


@pytest_asyncio.fixture
async def rules() -> AsyncIterator[Rules]:
    """Rules over a fresh CPU tier with CONFIG's limits."""
    store = TieredStore.from_urls(CONFIG.tiers, max_blob_bytes=CONFIG.max_block_bytes)
    metrics = ServerMetrics(version="test")
    budget = InflightBudget(
        CONFIG.max_inflight_bytes,
        CONFIG.max_inflight_bytes_per_client,
        CONFIG.stream_idle_timeout_s,
    )
    codes: dict[str | None, int] = {None: 0, store.tiers[0].name: 1}
    puts = PutRules(
        store,
        CONFIG,
        metrics,
        QuotaLedger(unit_bytes=store.page_bytes),
        BlockVerifier(CONFIG.max_block_bytes),
    )
    gets = GetRules(store, CONFIG, metrics, codes, budget.share_bytes)
    try:
        yield Rules(store, budget, puts, gets)
    finally:
        await store.close()


async def put_blocks(rules: Rules, tenant: Tenant, blobs: dict[bytes, bytes]) -> list[BlockResult]:
    """One Put of whole blocks (as the bulk stream hands them over); the results."""
    with rules.lease() as lease:
        intake = rules.puts.intake(tenant, lease, BULK_WORDING)
        for key, blob in blobs.items():
            await intake.open_block(key, len(blob))
            await intake.complete(key, memoryview(blob))
        return await intake.finish()


# -- Put admission ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("wording", "message"),
    [
        (
            FRAME_WORDING,
            "PutFrame.total_size: the stream's blocks add up to 3145728 bytes, over "
            "max_request_bytes 2097152",
        ),
        (
            BULK_WORDING,
            "PUT block #2: the blocks add up to 3145728 bytes, over max_request_bytes 2097152",
        ),
    ],
)
@pytest.mark.asyncio
async def test_a_put_over_max_request_bytes_is_refused_naming_the_field(
    rules: Rules, wording: PutWording, message: str
) -> None:
    with rules.lease() as lease:
        intake = rules.puts.intake(ANONYMOUS, lease, wording)
        assert await intake.open_block(key_of(0), MIB) == 0
        assert await intake.open_block(key_of(1), MIB) == 1
        with pytest.raises(Refusal) as err:
            await intake.open_block(key_of(2), MIB)
        assert (err.value.kind, err.value.reason, err.value.message) == (
            RefusalKind.OVER_LIMIT,
            "request_too_large",
            message,
        )
        # The two admitted blocks hold their bytes until the request ends.
        assert lease.held_bytes == 2 * MIB
    assert rules.budget.used_bytes == 0


@pytest.mark.asyncio
async def test_block_size_and_key_count_limits_name_the_field(rules: Rules) -> None:
    with rules.lease() as lease:
        intake = rules.puts.intake(ANONYMOUS, lease, FRAME_WORDING)
        with pytest.raises(Refusal) as err:
            await intake.open_block(key_of(0), 0)
        assert (err.value.kind, err.value.reason, err.value.message) == (
            RefusalKind.BAD_REQUEST,
            "bad_framing",
            "PutFrame.total_size: block #0 must give its size (> 0)",
        )
        with pytest.raises(Refusal) as err:
            await intake.open_block(key_of(0), MIB + 1)
        assert (err.value.kind, err.value.reason, err.value.message) == (
            RefusalKind.OVER_LIMIT,
            "block_too_large",
            f"PutFrame.total_size: block #0 is {MIB + 1} bytes, over max_block_bytes {MIB}",
        )
        for i in range(CONFIG.max_keys_per_request):
            await intake.open_block(key_of(i), 16)
        with pytest.raises(Refusal) as err:
            await intake.open_block(key_of(99), 16)
        assert (err.value.kind, err.value.reason, err.value.message) == (
            RefusalKind.OVER_LIMIT,
            "too_many_keys",
            "PutFrame.key: more than max_keys_per_request 64 blocks in one Put",
        )


@pytest.mark.asyncio
async def test_a_block_over_the_tenants_quota_is_refused_and_the_others_stored(
    rules: Rules,
) -> None:
    tenant = Tenant.named("t1", quota_bytes=4096)  # one page
    first, second = key_of(1), key_of(2)
    results = await put_blocks(rules, tenant, {first: block(first), second: block(second)})
    size = len(block(second))
    assert results[0] == BlockResult(first, PutOutcome.STORED)
    refusal = results[1].refusal
    assert results[1].key == second and results[1].outcome is None and refusal is not None
    assert (refusal.kind, refusal.reason, refusal.message) == (
        RefusalKind.OVER_LIMIT,
        "over_quota",
        f"block #1: quota: tenant t1 holds 4096 of its 4096-byte quota; this block needs "
        f"4096 more ({size} bytes in 4096-byte pages)",
    )
    stored = tenant.stored_key
    assert await rules.store.lookup([stored(first), stored(second)]) == ["cpu", None]


@pytest.mark.asyncio
async def test_an_invalid_block_is_refused_alone_and_a_repeat_is_already_present(
    rules: Rules,
) -> None:
    good, bad = key_of(1), key_of(2)
    broken = bytearray(block(bad))
    broken[-1] ^= 0xFF
    results = await put_blocks(rules, ANONYMOUS, {good: block(good), bad: bytes(broken)})
    assert results[0] == BlockResult(good, PutOutcome.STORED)
    refusal = results[1].refusal
    assert refusal is not None and results[1].outcome is None
    assert (refusal.kind, refusal.reason) == (RefusalKind.BAD_REQUEST, "invalid_block")
    assert refusal.message.startswith("block #1: checksum:")
    again = await put_blocks(rules, ANONYMOUS, {good: block(good)})
    assert again == [BlockResult(good, PutOutcome.ALREADY_PRESENT)]


@pytest.mark.asyncio
async def test_blocks_completed_out_of_order_are_staged_and_answered_by_position(
    rules: Rules,
) -> None:
    """The bulk stream verifies block n while receiving n+1: completions may finish in
    any order, results and stores follow the request's order."""
    keys = [key_of(20), key_of(21), key_of(22)]
    broken = bytearray(block(keys[1]))
    broken[-1] ^= 0xFF
    blobs = [block(keys[0]), bytes(broken), block(keys[2])]
    with rules.lease() as lease:
        intake = rules.puts.intake(ANONYMOUS, lease, BULK_WORDING)
        positions = [await intake.open_block(k, len(b)) for k, b in zip(keys, blobs, strict=True)]
        assert positions == [0, 1, 2]
        for i in (2, 0, 1):
            await intake.complete(keys[i], memoryview(blobs[i]), positions[i])
        assert [p for p, _, _ in intake.staged] == [0, 2]
        results = await intake.finish()
    assert [r.outcome for r in results] == [PutOutcome.STORED, None, PutOutcome.STORED]
    refusal = results[1].refusal
    assert refusal is not None and refusal.message.startswith("block #1: checksum:")
    assert await rules.store.lookup(keys) == ["cpu", None, "cpu"]


@pytest.mark.asyncio
async def test_frames_stage_a_partial_block_until_its_last_frame(rules: Rules) -> None:
    key = key_of(7)
    blob = block(key)
    view = memoryview(blob)
    with rules.lease() as lease:
        intake = rules.puts.intake(ANONYMOUS, lease, FRAME_WORDING)
        await intake.frame(key, len(blob), view[:100])
        assert intake.partial is not None and intake.staged == []
        await intake.frame(b"", 0, view[100:])
        assert intake.partial is None and [p for p, _, _ in intake.staged] == [0]
        intake.end_of_frames()
        assert await intake.finish() == [BlockResult(key, PutOutcome.STORED)]
    with rules.lease() as lease:
        intake = rules.puts.intake(ANONYMOUS, lease, FRAME_WORDING)
        await intake.frame(key_of(8), len(blob), view[:100])
        with pytest.raises(Refusal) as err:
            intake.end_of_frames()
        assert (err.value.kind, err.value.message) == (
            RefusalKind.BAD_REQUEST,
            f"PutFrame.data: the stream ended inside block #0 (100 of {len(blob)} bytes)",
        )
    assert await rules.store.lookup([key_of(8)]) == [None]


# -- Get -------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_packed_keys_are_checked_naming_the_field(rules: Rules) -> None:
    with pytest.raises(Refusal) as err:
        rules.gets.keys(b"x" * 17, "GetRequest.keys")
    assert (err.value.kind, err.value.reason, err.value.message) == (
        RefusalKind.BAD_REQUEST,
        "bad_keys",
        "GetRequest.keys: 17 bytes is not a multiple of the 16-byte key",
    )
    with pytest.raises(Refusal) as err:
        rules.gets.keys(bytes(16 * 65), "GetRequest.keys")
    assert (err.value.kind, err.value.reason, err.value.message) == (
        RefusalKind.OVER_LIMIT,
        "too_many_keys",
        "GetRequest.keys: 65 keys exceeds max_keys_per_request 64",
    )
    tenant = Tenant.named("t1")
    assert rules.gets.keys(key_of(1) + key_of(2), "f", tenant.namespace) == [
        tenant.stored_key(key_of(1)),
        tenant.stored_key(key_of(2)),
    ]


@pytest.mark.asyncio
async def test_both_reads_yield_each_hit_and_miss_in_request_order(rules: Rules) -> None:
    present = [key_of(1), key_of(3)]
    await put_blocks(rules, ANONYMOUS, {k: block(k) for k in present})
    keys = [key_of(0), key_of(1), key_of(2), key_of(3)]
    with rules.lease() as lease:
        windows = [
            (i, code, None if blob is None else bytes(blob))
            async for i, code, blob in rules.gets.windows(ANONYMOUS, keys, lease)
        ]
    assert windows == [
        (0, 0, None),
        (1, 1, block(key_of(1))),
        (2, 0, None),
        (3, 1, block(key_of(3))),
    ]
    buffer = SendBuffer()
    with rules.lease() as lease:
        into = [
            (code, b"".join(buffer.parts))
            async for code, size in rules.gets.into(ANONYMOUS, keys, lease, buffer)
        ]
    assert into == [(0, b""), (1, block(key_of(1))), (0, b""), (1, block(key_of(3)))]
    assert rules.budget.used_bytes == 0


@pytest.mark.asyncio
async def test_a_get_yields_exactly_what_the_grpc_path_sends() -> None:
    running = await start_server(CONFIG, monitor_interval_s=0.2)
    channel = grpc.aio.insecure_channel(running.address)
    try:
        stub = cache_pb2_grpc.KVCacheStub(channel)
        present = [key_of(5), key_of(6)]
        frames = [pb.PutFrame(key=k, total_size=len(block(k)), data=block(k)) for k in present]

        async def requests() -> AsyncIterator[pb.PutFrame]:
            for f in frames:
                yield f

        reply = await stub.Put(requests())
        assert [r.outcome for r in reply.results] == [pb.PUT_OUTCOME_STORED] * 2
        keys = [key_of(4), key_of(5), key_of(9), key_of(6)]
        over_grpc: list[tuple[int, int, bytes | None]] = []
        async for frame in stub.Get(pb.GetRequest(keys=b"".join(keys))):
            # Blocks of a few hundred bytes: one frame each.
            over_grpc.append((frame.index, frame.tier, frame.data or None))
        with running.service.inflight.lease("direct") as lease:
            direct = [
                (i, code, None if blob is None else bytes(blob))
                async for i, code, blob in running.service.gets.windows(ANONYMOUS, keys, lease)
            ]
        assert direct == over_grpc
        assert [hit for _, _, hit in direct] == [None, block(key_of(5)), None, block(key_of(6))]
    finally:
        await channel.close(None)
        await running.stop(grace_s=1.0)


@pytest.mark.parametrize("module", ["transfer_put", "transfer_get", "refusal"])
def test_the_rules_import_no_transport(module: str) -> None:
    # The rules speak domain values: no gRPC, no protobuf messages, no sockets.
    path = Path(__file__).parents[2] / "nopecache" / "cache_server" / f"{module}.py"
    imported: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
            imported.update(f"{node.module}.{alias.name}" for alias in node.names)
    transports = {"grpc", "socket", "nopecache.proto.cache_pb2", "nopecache.proto.cache_pb2_grpc"}
    assert imported & transports == set()
    assert not any(name.startswith("grpc") for name in imported)
