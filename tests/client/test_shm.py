"""The same-host shared-memory fast path: real server processes, real /dev/shm segments.

Every test names its segments with a prefix of its own, so "nothing left in /dev/shm"
is checked for exactly the segments the test made (other suites may run at once).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
import torch

from nopecache.cache_server.refusal import Refusal, RefusalKind
from nopecache.cache_server.shm import ShmLimits, ShmSessions
from nopecache.client import (
    FetchResult,
    InvalidArgumentError,
    PagedKV,
)
from nopecache.client import shm as client_shm
from nopecache.client.shm import Segment, ShmFastPath, sweep_orphans
from nopecache.client.transport import ServerConnection
from nopecache.proto import cache_pb2 as pb
from nopecache.proto.block import StoredForm, encode_block
from tests.support.server_procs import CacheServerProc, start_cache_servers
from tests.support.shm_client import (
    BIG,
    BIG_TOKENS,
    DIM,
    FP,
    HEADS,
    LAYERS,
    SEGMENT,
    client,
    config,
    kv,
    prompt,
)


def prefix() -> str:
    """A segment name prefix no other test uses."""
    return f"nopecache-test-{uuid.uuid4().hex[:12]}-"


def leftovers(name_prefix: str) -> list[str]:
    """Names in /dev/shm made with ``name_prefix``."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(name_prefix))


def _held(pid: int) -> list[str]:
    """The mappings of ``pid`` and its open descriptors, as lines ending in the path
    (``/proc/PID/maps`` lines; descriptors as ``fd N <path>``, the server's way to hold a
    segment without mapping it)."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    fds = Path(f"/proc/{pid}/fd")
    for fd in fds.iterdir():
        try:
            lines.append(f"fd {fd.name} {os.readlink(fd)}")
        except OSError:  # closed meanwhile
            continue
    return lines


def mapped_by(pid: int, name_prefix: str) -> list[str]:
    """Mappings and descriptors of process ``pid`` whose file name starts with
    ``name_prefix``."""
    return [line for line in _held(pid) if f"/dev/shm/{name_prefix}" in line]


def line_is_deleted(pid: int, path: str) -> bool:
    """Whether ``pid`` holds ``path`` and the kernel marks it unlinked."""
    return any(line.endswith(f"{path} (deleted)") for line in _held(pid))


BIG_KV = kv(BIG_TOKENS, seed=7)
SMALL = prompt(700, seed=8)
SMALL_KV = kv(700, seed=8)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CacheServerProc]:
    """One server holding BIG (prefix blocks) and SMALL (prefix and content blocks)."""
    (proc,) = start_cache_servers(
        1, tmp_path_factory.mktemp("shm-server"), tiers=("cpu://?capacity=96MiB&pinned=no",)
    )
    try:
        with client(config(proc, shm="off")) as c:
            assert c.store(BIG, BIG_KV, 0, position_independent=False).failed == 0
            assert c.store(SMALL, SMALL_KV, 0).failed == 0
        yield proc
    finally:
        proc.kill()


def fetch_both(
    server: CacheServerProc, tokens: torch.Tensor, fast_path: ShmFastPath, *, pi: bool = True
) -> tuple[FetchResult, FetchResult]:
    """The same plan fetched over gRPC (shm off) and through ``fast_path``."""
    with client(config(server, shm="off")) as c:
        plan = c.lookup(tokens, allow_position_independent=pi)
        by_grpc = c.fetch(plan, tokens)
    with client(config(server), fast_path) as c:
        by_shm = c.fetch(plan, tokens)
    return by_grpc, by_shm


def same_tensors(a: FetchResult, b: FetchResult) -> bool:
    """Whether two contiguous fetch results hold bit-identical K, V and masks."""
    assert a.k is not None and a.v is not None and b.k is not None and b.v is not None
    return torch.equal(a.mask, b.mask) and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


# -- the fast path gives exactly what gRPC gives --------------------------------------------
def test_shm_fetch_places_the_same_tensors_as_grpc(server: CacheServerProc) -> None:
    name_prefix = prefix()
    fast = ShmFastPath("auto", zero_copy=False, segment_bytes=SEGMENT, name_prefix=name_prefix)
    by_grpc, by_shm = fetch_both(server, SMALL, fast)
    assert by_grpc.failed == by_shm.failed == ()
    assert by_grpc.placed == by_shm.placed
    assert len(by_shm.placed) > 5
    assert same_tensors(by_grpc, by_shm)
    stats = fast.stats()
    assert stats.shm_blocks == len({h.key for h in by_shm.placed})
    assert stats.shm_bytes == by_shm.nbytes and stats.grpc_bytes == stats.grpc_blocks == 0
    assert stats.sessions == 0 and stats.refused == 0  # closed with the client
    assert leftovers(name_prefix) == []


def test_more_bytes_than_the_segment_recycle_windows_into_a_paged_cache(
    server: CacheServerProc,
) -> None:
    """12 MiB through an 8 MiB segment: windows come back as blocks are placed."""
    name_prefix = prefix()
    fast = ShmFastPath(
        "auto", zero_copy=False, segment_bytes=SEGMENT, name_prefix=name_prefix, space_wait_s=30
    )
    pages = BIG_TOKENS // 16
    table = torch.randperm(pages, generator=torch.Generator().manual_seed(3))
    slots = (table[:, None] * 16 + torch.arange(16)).reshape(-1)

    caches: list[list[torch.Tensor]] = []  # K then V caches, per run
    for fast_path, shm in ((None, "off"), (fast, "auto")):
        shape = (pages, 16, HEADS, DIM)
        k_caches = [torch.zeros(shape) for _ in range(LAYERS)]
        v_caches = [torch.zeros(shape) for _ in range(LAYERS)]
        with client(config(server, shm), fast_path) as c:
            plan = c.lookup(BIG, allow_position_independent=False)
            assert plan.prefix_end == BIG_TOKENS
            result = c.fetch(plan, BIG, into=PagedKV(k_caches, v_caches, slots))
            assert result.failed == () and result.placed_tokens == BIG_TOKENS
        caches.append(k_caches + v_caches)
    for a, b in zip(*caches, strict=True):
        assert torch.equal(a, b)
    v0 = caches[1][LAYERS].view(-1, HEADS, DIM)[slots]
    assert torch.equal(v0, BIG_KV[1][0])  # V is placed as stored
    stats = fast.stats()
    assert (stats.shm_blocks, stats.grpc_blocks) == (12, 0)
    assert stats.shm_bytes > 12 * 2**20
    assert leftovers(name_prefix) == []


async def _blobs(
    conn: ServerConnection, keys: bytes, keep: bool, fast: ShmFastPath | None = None
) -> list[bytes | None]:
    """The blocks of ``keys`` as bytes (``keep``: holding on to every view meanwhile)."""
    out: list[bytes | None] = []
    held = []
    async for _, blob in conn.get(keys):
        out.append(None if blob is None else bytes(blob))
        if keep:
            held.append(blob)  # a consumer that never lets go of its views
    if fast is not None:
        await fast.close()
    await conn.close()
    return out


def test_a_consumer_holding_every_view_gets_the_rest_over_grpc(server: CacheServerProc) -> None:
    """No deadlock when nothing is released: once the segment is full, gRPC carries on."""
    with client(config(server, "off")) as c:
        plan = c.lookup(BIG, allow_position_independent=False)
    keys = b"".join(h.key.value for h in plan.blocks) + bytes(16)  # and a miss at the end
    cfg = config(server)
    want = asyncio.run(_blobs(ServerConnection(server.address, cfg), keys, keep=False))
    name_prefix = prefix()
    fast = ShmFastPath(
        "auto", zero_copy=False, segment_bytes=SEGMENT, name_prefix=name_prefix, space_wait_s=0
    )
    conn = ServerConnection(server.address, cfg, fast_path=fast)
    got = asyncio.run(_blobs(conn, keys, True, fast))
    assert got == want and want[-1] is None and all(b is not None for b in want[:-1])
    stats = fast.stats()
    # Windows: 1 key (its size unknown yet), then 3 and 3 (half the segment each); the 8 MiB
    # segment has no room for an eighth block of 1 MiB + header while all are held.
    assert (stats.shm_blocks, stats.grpc_blocks) == (7, 5)
    assert leftovers(name_prefix) == []


# -- fallbacks ------------------------------------------------------------------------------
def test_shm_off_never_attaches(server: CacheServerProc) -> None:
    assert server.proc is not None
    ours = f"{client_shm.SEGMENT_PREFIX}{os.getpid()}-"
    before = mapped_by(server.proc.pid, ours)
    with client(config(server, shm="off")) as c:
        assert c.core.shm is None
        plan = c.lookup(SMALL)
        assert c.fetch(plan, SMALL).failed == ()
        assert mapped_by(server.proc.pid, ours) == before


def test_auto_is_wired_in_by_default_and_detaches_on_close(server: CacheServerProc) -> None:
    assert server.proc is not None
    with client(config(server)) as c:
        fast = c.core.shm
        assert isinstance(fast, ShmFastPath) and fast.mode == "auto"
        plan = c.lookup(SMALL)
        assert c.fetch(plan, SMALL).failed == ()
        assert fast.stats().shm_blocks > 0 and fast.stats().sessions == 1
        # The server maps the (already unlinked) segment until the client detaches.
        ours = f"{client_shm.SEGMENT_PREFIX}{os.getpid()}-"
        (mapping,) = {line.split()[-2] for line in mapped_by(server.proc.pid, ours)}
        assert line_is_deleted(server.proc.pid, mapping)
        assert not os.path.exists(mapping)
    assert mapped_by(server.proc.pid, ours) == []
    assert fast.stats().sessions == 0


def test_a_server_that_cannot_open_the_segment_means_grpc_without_errors(
    server: CacheServerProc, tmp_path: Path
) -> None:
    """Another host, simulated: the segment is made where the server does not look."""
    fast = ShmFastPath("on", zero_copy=False, segment_bytes=SEGMENT, shm_dir=str(tmp_path))
    by_grpc, by_shm = fetch_both(server, SMALL, fast)
    assert by_shm.failed == () and same_tensors(by_grpc, by_shm)
    stats = fast.stats()
    assert (stats.refused, stats.shm_blocks, stats.sessions) == (1, 0, 0)
    assert stats.grpc_bytes == by_shm.nbytes
    assert list(tmp_path.iterdir()) == []


def test_auto_skips_a_server_on_another_host_without_asking(server: CacheServerProc) -> None:
    fast = ShmFastPath("auto", zero_copy=False, segment_bytes=SEGMENT, name_prefix=prefix())
    fast.host_id = "elsewhere/0"  # what this process would be on another machine
    conn = ServerConnection(server.address, config(server), fast_path=fast)
    got = asyncio.run(_blobs(conn, bytes(32), keep=False))
    assert got == [None, None]
    assert fast.stats() == client_shm.ShmStats()  # not even attempted


def test_a_lost_session_falls_back_for_the_call(tmp_path: Path) -> None:
    (proc,) = start_cache_servers(1, tmp_path)
    try:
        name_prefix = prefix()
        fast = ShmFastPath("auto", zero_copy=False, segment_bytes=SEGMENT, name_prefix=name_prefix)
        with client(config(proc), fast) as c:
            c.store(SMALL, SMALL_KV, 0)
            plan = c.lookup(SMALL)
            first = c.fetch(plan, SMALL)
            assert fast.stats().shm_blocks > 0
            proc.kill()  # the server's sessions die with it
            proc.start()
            # Its CPU tier died too: store again, once the client sees the server back.
            # Returns once the client sees the server back (~1 s idle); a hang guard.
            deadline = time.monotonic() + 60
            while c.lookup(SMALL).reused_tokens != plan.reused_tokens:
                assert time.monotonic() < deadline, "the restarted server never came back"
                c.store(SMALL, SMALL_KV, 0)
                time.sleep(0.1)
            before = fast.stats()
            second = c.fetch(plan, SMALL)
        assert second.failed == () and first.k is not None and second.k is not None
        assert torch.equal(first.k, second.k)
        after = fast.stats()
        assert after.lost == 1 and after.shm_blocks == before.shm_blocks
        assert after.grpc_bytes - before.grpc_bytes == second.nbytes
        assert leftovers(name_prefix) == []
    finally:
        proc.kill()


# -- no segment is left behind -----------------------------------------------------------------
CHILD = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {root!r})
    from tests.support.shm_client import BIG, SEGMENT, client, config
    from nopecache.client.shm import ShmFastPath
    fast = ShmFastPath("auto", zero_copy=False, segment_bytes=SEGMENT, name_prefix={prefix!r})
    c = client(config({address!r}), fast)
    plan = c.lookup(BIG, allow_position_independent=False)
    while True:
        result = c.fetch(plan, BIG)
        assert result.failed == () and fast.stats().shm_blocks, fast.stats()
        print("fetched", flush=True)
    """
)


def test_a_client_killed_mid_fetch_leaves_nothing_in_dev_shm(server: CacheServerProc) -> None:
    assert server.proc is not None
    name_prefix = prefix()
    code = CHILD.format(
        root=str(Path(__file__).resolve().parents[2]), address=server.address, prefix=name_prefix
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line == b"fetched\n", line + child.stdout.read()
        time.sleep(0.05)  # into the next fetch
        assert mapped_by(child.pid, name_prefix) != []  # it still holds its segment
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        child.kill()
    assert leftovers(name_prefix) == []
    # The server still maps it (until idle expiry), and serves the next client as before.
    assert mapped_by(server.proc.pid, name_prefix) != []
    fast = ShmFastPath("auto", zero_copy=False, segment_bytes=SEGMENT, name_prefix=prefix())
    by_grpc, by_shm = fetch_both(server, BIG, fast, pi=False)
    assert same_tensors(by_grpc, by_shm) and fast.stats().shm_blocks == 12


def test_sweep_removes_only_old_names_of_its_prefix(tmp_path: Path) -> None:
    old_ours, new_ours = tmp_path / "nopecache-x-1", tmp_path / "nopecache-x-2"
    old_theirs = tmp_path / "other-1"
    for path in (old_ours, new_ours, old_theirs):
        path.write_bytes(b"")
    hour_ago = time.time() - 3600
    for path in (old_ours, old_theirs):
        os.utime(path, (hour_ago, hour_ago))
    assert sweep_orphans("nopecache-x-", shm_dir=str(tmp_path)) == ["nopecache-x-1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nopecache-x-2", "other-1"]


# -- the server's session table ------------------------------------------------------------------
class Clock:
    """A settable clock for the session table."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _session_lifecycle(name_prefix: str) -> None:
    clock = Clock()
    table = ShmSessions(ShmLimits(idle_s=60.0, max_sessions=2), clock=clock)
    segs = [Segment.create(SEGMENT, prefix=name_prefix) for _ in range(4)]
    try:
        a = await table.attach("t1", segs[0].name, segs[0].size, segs[0].nonce)
        assert len(a.session) == 16 and a.refused == "" and segs[0].session_ack() == a.session
        clock.now += 30
        b = await table.attach("t1", segs[1].name, segs[1].size, segs[1].nonce)
        assert (table.sessions, table.mapped_bytes) == (2, 2 * SEGMENT)
        # Another tenant cannot use or end t1's session.
        with pytest.raises(Refusal, match=r"GetRequest\.shm_session: no session") as err:
            table.target("t2", a.session, 4096, 4096)
        assert err.value.kind is RefusalKind.STALE_SESSION
        assert not table.detach("t2", a.session)
        # A window outside the segment's windows names the fields.
        with pytest.raises(Refusal, match=r"shm_offset/shm_size: window \[0, 4096\)"):
            table.target("t1", a.session, 0, 4096)
        # The table is full: the least recently used session without a Get in flight is
        # evicted. a is the least recently used (b was used after it) but busy: b goes.
        with table.target("t1", a.session, 4096, 4096) as target:
            table.target("t1", b.session, 4096, 64).close()
            assert target.place(b"x" * 100) == 4096 and target.place(b"y" * 10) == 4096 + 128
            assert target.place(b"z" * 4000) is None  # does not fit the rest of the window
            with table.target("t1", a.session, 4096 + 64, 64) as overlapping:
                assert overlapping.place(b"w") is None  # a Get in flight owns that range
            c = await table.attach("t1", segs[2].name, segs[2].size, segs[2].nonce)
            assert c.session and table.sessions == 2 and not table.detach("t1", b.session)
        assert segs[0].mm is not None and segs[0].mm[4096:4100] == b"xxxx"
        assert segs[0].mm[4096 + 128 : 4096 + 138] == b"y" * 10
        # Expiry: idle for idle_s.
        clock.now += 59
        assert table.expire() == 0
        clock.now += 1
        assert table.expire() == 2 and table.sessions == 0
        # Detach unmaps at once; while a Get is in flight, when it ends.
        d = await table.attach("t1", segs[3].name, segs[3].size, segs[3].nonce)
        segs[3].close()  # this process's client side lets go: only the table maps it now
        assert len(mapped_by(os.getpid(), segs[3].name)) == 1
        target = table.target("t1", d.session, 4096, 64)
        assert table.detach("t1", d.session) and table.sessions == 0
        assert len(mapped_by(os.getpid(), segs[3].name)) == 1
        target.close()
        assert mapped_by(os.getpid(), segs[3].name) == []
    finally:
        table.close()
        for seg in segs:
            seg.close()


def test_sessions_end_on_detach_expiry_and_eviction() -> None:
    name_prefix = prefix()
    asyncio.run(_session_lifecycle(name_prefix))
    assert leftovers(name_prefix) == []
    assert mapped_by(os.getpid(), name_prefix) == []


async def _refusals(name_prefix: str) -> None:
    table = ShmSessions(ShmLimits(max_segment_bytes=SEGMENT))
    seg = Segment.create(SEGMENT, prefix=name_prefix)
    big = Segment.create(2 * SEGMENT, prefix=name_prefix)
    try:
        wrong = await table.attach("t", seg.name, seg.size, bytes(16))
        assert wrong.session == b"" and "magic and nonce" in wrong.refused
        gone = await table.attach("t", name_prefix + "nothing", seg.size, seg.nonce)
        assert gone.refused.startswith("segment: cannot open") and "No such file" in gone.refused
        size = await table.attach("t", seg.name, seg.size - 4096, seg.nonce)
        assert f"is {SEGMENT} bytes, the request says {SEGMENT - 4096}" in size.refused
        over = await table.attach("t", big.name, big.size, big.nonce)
        assert "over this server's max_segment_bytes" in over.refused
        for name, nonce, size_, field in (
            ("../etc/passwd", seg.nonce, seg.size, "AttachShmRequest.name"),
            ("nopecache-a/b", seg.nonce, seg.size, "AttachShmRequest.name"),
            (seg.name, b"short", seg.size, "AttachShmRequest.nonce"),
            (seg.name, seg.nonce, 100, "AttachShmRequest.size"),
        ):
            with pytest.raises(Refusal, match=f"^{field}") as err:
                await table.attach("t", name, size_, nonce)
            assert err.value.kind is RefusalKind.BAD_REQUEST
        assert table.sessions == 0
    finally:
        seg.close()
        big.close()


def test_segments_that_are_not_the_clients_memory_are_refused_as_values() -> None:
    name_prefix = prefix()
    asyncio.run(_refusals(name_prefix))
    assert leftovers(name_prefix) == []


async def _wire(server: CacheServerProc, name_prefix: str) -> None:
    """AttachShm and Get on the wire: fitting hits in the window, the rest as data."""
    conn = ServerConnection(server.address, config(server, "off"))
    blobs = []
    for i in range(3):
        k, v = kv(40, seed=100 + i)
        key = bytes([i + 1]) * 16
        blob = encode_block(
            key=key,
            fingerprint=FP.to_bytes(),
            form=StoredForm.NOPE,
            k=k,
            v=v,
            token_ids=list(range(40)),
        )
        blobs.append((key, blob))
    assert all(r.ok for r in await conn.put(blobs))
    seg = Segment.create(SEGMENT, prefix=name_prefix)
    attach = conn.channel.unary_unary(
        "/nopecache.v1.KVCache/AttachShm",
        request_serializer=pb.AttachShmRequest.SerializeToString,
        response_deserializer=pb.AttachShmReply.FromString,
    )
    reply = await attach(pb.AttachShmRequest(name=seg.name, size=seg.size, nonce=seg.nonce))
    seg.unlink()
    assert reply.refused == "" and reply.idle_timeout_ms == 120_000
    get = conn.channel.unary_stream(
        "/nopecache.v1.KVCache/Get",
        request_serializer=pb.GetRequest.SerializeToString,
        response_deserializer=pb.GetFrame.FromString,
    )
    size = len(blobs[0][1])
    keys = blobs[0][0] + bytes(16) + blobs[1][0] + blobs[2][0]
    window = 2 * size + 64  # two blocks fit (the second one 64-byte aligned), not three
    frames = [
        f
        async for f in get(
            pb.GetRequest(keys=keys, shm_session=reply.session, shm_offset=8192, shm_size=window)
        )
    ]
    at = [(f.index, f.shm_offset, f.shm_length, len(f.data)) for f in frames]
    second = 8192 + -(-size // 64) * 64
    assert at == [(0, 8192, size, 0), (1, 0, 0, 0), (2, second, size, 0), (3, 0, 0, size)]
    assert seg.mm is not None
    assert seg.mm[8192 : 8192 + size] == blobs[0][1] and frames[3].data == blobs[2][1]
    assert seg.mm[second : second + size] == blobs[1][1]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        [
            f
            async for f in get(
                pb.GetRequest(keys=keys, shm_session=bytes(16), shm_size=64, shm_offset=4096)
            )
        ]
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "GetRequest.shm_session: no session" in (err.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        [
            f
            async for f in get(
                pb.GetRequest(
                    keys=keys, shm_session=reply.session, shm_offset=seg.size, shm_size=64
                )
            )
        ]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    detach = conn.channel.unary_unary(
        "/nopecache.v1.KVCache/DetachShm",
        request_serializer=pb.DetachShmRequest.SerializeToString,
        response_deserializer=pb.DetachShmReply.FromString,
    )
    assert (await detach(pb.DetachShmRequest(session=reply.session))).detached
    assert not (await detach(pb.DetachShmRequest(session=reply.session))).detached
    seg.close()
    await conn.close()


def test_the_server_writes_what_fits_and_sends_the_rest_as_data(server: CacheServerProc) -> None:
    name_prefix = prefix()
    asyncio.run(_wire(server, name_prefix))
    assert server.proc is not None and mapped_by(server.proc.pid, name_prefix) == []


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"mode": "sometimes"}, "mode"),
        ({"segment_bytes": 1024}, "segment_bytes"),
        ({"segment_bytes": True}, "segment_bytes"),
        ({"name_prefix": "other-"}, "name_prefix"),
        ({"name_prefix": "nopecache-a/b"}, "name_prefix"),
        ({"space_wait_s": -1}, "space_wait_s"),
    ],
)
def test_bad_fast_path_arguments_name_the_argument(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=f"^{field}: "):
        ShmFastPath(**kwargs)  # type: ignore[arg-type]
