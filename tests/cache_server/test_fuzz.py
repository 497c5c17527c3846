"""Fuzzing the wire: hypothesis over the request messages (keys, sizes, frames, mutated
valid blocks, tokens) and raw garbage bytes on every method, against a real server
process with auth, tenants and a quota on. Every reply must be a defined status (never
UNKNOWN or INTERNAL), the server must stay up, and a digest of everything stored must
not move unless a block was stored or deleted for real.

Bounded: a few hundred inputs in all (the ``ci`` hypothesis profile, derandomized);
``bench/fuzz.py`` runs the same idea for longer with random mutations.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from nopecache.proto import cache_pb2 as pb
from tests.support.server_harness import key_of, make_block
from tests.support.server_procs import CacheServerProc, start_cache_servers
from tests.support.tenants import ALICE, BOB

SERVICE = "/nopecache.v1.KVCache/"
# Statuses a request may end with; anything else (UNKNOWN, INTERNAL, UNAVAILABLE, a
# DEADLINE_EXCEEDED from a hang) is a server bug.
DEFINED = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.FAILED_PRECONDITION,  # a Get naming an unknown shm session
    }
)
MAX_KEYS = 64
POOL = [key_of(i) for i in range(16)]
SEEDS = {ALICE: POOL[:4], BOB: POOL[4:8]}  # never deleted by a valid request
FREE = POOL[8:]  # fuzzed Puts and Deletes may store and remove these
# Small and large (multi-frame, over the quota) valid blocks per pool key.
BLOBS = {k: [make_block(k), make_block(k, tokens=300, head_dim=64)] for k in POOL}
AUTHORIZATIONS = [f"Bearer {ALICE}", f"Bearer {BOB}", None, f"Bearer {ALICE[:-1]}Z", "Basic x"]
# (method, status) of every fuzzed request, printed at the end (pytest -s).
TRIED: collections.Counter[tuple[str, str]] = collections.Counter()


@dataclass
class FuzzTarget:
    """A server process plus a plain channel, and the digest of what it stores."""

    server: CacheServerProc
    channel: grpc.Channel
    baseline: bytes = b""

    def fuzz(
        self, method: str, payload: bytes | Sequence[bytes], authorization: str | None
    ) -> tuple[grpc.StatusCode, list[bytes]]:
        """``call`` for a fuzzed input: counted in TRIED."""
        code, replies = self.call(method, payload, authorization)
        TRIED[(method, code.name)] += 1
        return code, replies

    def call(
        self, method: str, payload: bytes | Sequence[bytes], authorization: str | None
    ) -> tuple[grpc.StatusCode, list[bytes]]:
        """Send raw request bytes (a list for the client stream of Put); status and replies."""
        metadata: tuple[tuple[str, str | bytes], ...] | None = (
            (("authorization", authorization),) if authorization else None
        )
        path = SERVICE + method
        try:
            if method == "Put":
                assert not isinstance(payload, bytes)
                put = self.channel.stream_unary(path, None, None)
                return grpc.StatusCode.OK, [put(iter(payload), metadata=metadata, timeout=20)]
            assert isinstance(payload, bytes)
            if method == "Get":
                get = self.channel.unary_stream(path, None, None)
                return grpc.StatusCode.OK, list(get(payload, metadata=metadata, timeout=20))
            unary = self.channel.unary_unary(path, None, None)
            return grpc.StatusCode.OK, [unary(payload, metadata=metadata, timeout=20)]
        except grpc.RpcError as e:
            return e.code(), []

    def digest(self) -> bytes:
        """Every pool key's blob for both tenants, plus the tier occupancy."""
        h = xxhash.xxh3_128()
        for token in (ALICE, BOB):
            code, frames = self.call(
                "Get", pb.GetRequest(keys=b"".join(POOL)).SerializeToString(), f"Bearer {token}"
            )
            assert code == grpc.StatusCode.OK
            for raw in frames:
                h.update(raw)
        code, (stats,) = self.call("Stats", b"", f"Bearer {ALICE}")
        assert code == grpc.StatusCode.OK
        for t in pb.StatsReply.FromString(stats).tiers:
            h.update(f"{t.name}:{t.used_bytes}:{t.entries};".encode())
        return h.digest()

    def check(self, code: grpc.StatusCode, changed: bool, what: str) -> None:
        """The server is up, ``code`` is defined, and the digest moved only if ``changed``."""
        assert self.server.running(), f"server died on {what}:\n{self.server.log_tail()}"
        assert code in DEFINED, f"{code.name} on {what}:\n{self.server.log_tail()}"
        before, self.baseline = self.baseline, self.digest()
        # (The baseline moves first so that hypothesis' shrinking replays compare to the
        # state each replay really started from.)
        if not changed:
            assert self.baseline == before, f"stored blocks changed by a refused {what}"


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzTarget]:
    """A server with auth (alice, bob), a 48 KiB quota, small limits, and seeded blocks."""
    workdir = tmp_path_factory.mktemp("fuzz")
    tokens = workdir / "tokens"
    tokens.write_text(f"{ALICE} alice\n{BOB} bob\n")
    extra = [
        *("--auth-tokens-file", str(tokens), "--tenant-quota", "48KiB"),
        *("--max-message-bytes", "64KiB", "--max-block-bytes", "256KiB"),
        *("--max-request-bytes", "512KiB", "--max-keys-per-request", str(MAX_KEYS)),
    ]
    (server,) = start_cache_servers(
        1, Path(workdir), tiers=("cpu://?capacity=4MiB&page=4KiB&pinned=no",), extra_args=extra
    )
    channel = grpc.insecure_channel(server.address)
    fuzz = FuzzTarget(server, channel)
    try:
        for token, keys in SEEDS.items():
            frames = [
                pb.PutFrame(key=k, total_size=len(BLOBS[k][0]), data=BLOBS[k][0]) for k in keys
            ]
            code, _ = fuzz.call("Put", [f.SerializeToString() for f in frames], f"Bearer {token}")
            assert code == grpc.StatusCode.OK
        fuzz.baseline = fuzz.digest()
        yield fuzz
    finally:
        channel.close()
        server.kill()
        print(f"\nfuzz inputs tried: {sum(TRIED.values())}")
        for (method, status), n in sorted(TRIED.items()):
            print(f"  {method:12} {status:20} {n}")


# -- strategies ----------------------------------------------------------------------------
KEY = st.one_of(st.sampled_from(POOL), st.binary(min_size=16, max_size=16))
PACKED = st.one_of(
    st.lists(KEY, max_size=MAX_KEYS + 6).map(b"".join),
    st.binary(max_size=300),
)
# Mostly valid tokens, so most inputs get past the gate into the service.
AUTH = st.sampled_from([*AUTHORIZATIONS[:2] * 3, *AUTHORIZATIONS[2:]])


@st.composite
def delete_keys(draw: st.DrawFn) -> tuple[bytes, bool]:
    """(packed keys, whether the request is valid); seeds only ever in invalid ones."""
    if draw(st.booleans()):
        keys = draw(
            st.lists(
                st.one_of(st.sampled_from(FREE), KEY.filter(lambda k: k not in POOL)), max_size=8
            )
        )
        return b"".join(keys), True
    seeds = draw(st.lists(st.sampled_from(POOL[:8]), min_size=1, max_size=4))
    if draw(st.booleans()):
        return b"".join(seeds) + draw(st.binary(min_size=1, max_size=15)), False
    return b"".join(seeds * (MAX_KEYS // len(seeds) + 1)), False


@st.composite
def mutated(draw: st.DrawFn, blob: bytes) -> bytes:
    """``blob`` with byte flips, a cut or an extension (or left intact)."""
    kind = draw(st.sampled_from(["intact", "flip", "cut", "extend"]))
    if kind == "intact":
        return blob
    if kind == "cut":
        return blob[: draw(st.integers(0, len(blob) - 1))]
    if kind == "extend":
        return blob + draw(st.binary(min_size=1, max_size=64))
    out = bytearray(blob)
    for offset in draw(st.lists(st.integers(0, len(blob) - 1), min_size=1, max_size=4)):
        out[offset] ^= draw(st.integers(1, 255))
    return bytes(out)


@st.composite
def put_frames(draw: st.DrawFn) -> list[bytes]:
    """A Put stream: blocks (maybe mutated, maybe mislabelled, split anyhow) and junk."""
    frames: list[bytes] = []
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.integers(0, 19)) == 0:
            frames.append(draw(st.binary(max_size=80)))
            continue
        key = draw(st.sampled_from(POOL))
        blob = draw(mutated(draw(st.sampled_from(BLOBS[key]))))
        # Mostly well-labelled, so that many streams reach block validation.
        label = draw(st.sampled_from([key] * 6 + [key[::-1], b"", b"k" * 15]))
        size = draw(st.sampled_from([len(blob)] * 8 + [0, len(blob) + 1, 2**64 - 1]))
        # At most ~8 frames per block: enough to exercise reassembly, cheap to send.
        step = draw(st.integers(max(1, len(blob) // 8), max(1, len(blob))))
        first = pb.PutFrame(key=label, total_size=size, data=blob[:step])
        frames.append(first.SerializeToString())
        frames.extend(
            pb.PutFrame(data=blob[i : i + step]).SerializeToString()
            for i in range(step, len(blob), step)
        )
    return frames


def _stored(replies: list[bytes]) -> bool:
    return any(
        r.outcome == pb.PUT_OUTCOME_STORED for r in pb.PutReply.FromString(replies[0]).results
    )


# -- the fuzz tests ------------------------------------------------------------------------
@settings(max_examples=120)
@given(method=st.sampled_from(["Lookup", "Get", "Stats"]), keys=PACKED, auth=AUTH)
def test_queries_with_random_keys(
    target: FuzzTarget, method: str, keys: bytes, auth: str | None
) -> None:
    request = pb.LookupRequest(keys=keys) if method != "Stats" else pb.StatsRequest()
    code, _ = target.fuzz(method, request.SerializeToString(), auth)
    target.check(code, changed=False, what=method)


@settings(max_examples=80)
@given(request=delete_keys(), auth=AUTH)
def test_deletes(target: FuzzTarget, request: tuple[bytes, bool], auth: str | None) -> None:
    keys, valid = request
    code, replies = target.fuzz("Delete", pb.DeleteRequest(keys=keys).SerializeToString(), auth)
    deleted = code == grpc.StatusCode.OK and pb.DeleteReply.FromString(replies[0]).deleted > 0
    assert not (deleted and not valid)
    target.check(code, changed=deleted, what="Delete")


@settings(max_examples=150)
@given(frames=put_frames(), auth=AUTH)
def test_put_streams(target: FuzzTarget, frames: list[bytes], auth: str | None) -> None:
    code, replies = target.fuzz("Put", frames, auth)
    stored = code == grpc.StatusCode.OK and _stored(replies)
    target.check(code, changed=stored, what="Put")


@settings(max_examples=100)
@given(
    method=st.sampled_from(
        [
            "Lookup",
            "Get",
            "Delete",
            "Stats",
            "Put",
            "AttachShm",
            "DetachShm",
            "OpenArena",
            "LeaseGet",
            "ReleaseLeases",
            "NoSuchMethod",
        ]
    ),
    payload=st.lists(st.binary(max_size=200), min_size=1, max_size=4),
    auth=AUTH,
)
def test_raw_garbage_bytes(
    target: FuzzTarget, method: str, payload: list[bytes], auth: str | None
) -> None:
    code, replies = target.fuzz(method, payload if method == "Put" else payload[0], auth)
    stored = method == "Put" and code == grpc.StatusCode.OK and _stored(replies)
    target.check(code, changed=stored, what=f"raw {method}")


def test_the_server_is_still_healthy_after_the_fuzzing(target: FuzzTarget) -> None:
    assert target.server.running()
    for token, keys in SEEDS.items():
        code, frames = target.call(
            "Get", pb.GetRequest(keys=b"".join(keys)).SerializeToString(), f"Bearer {token}"
        )
        assert code == grpc.StatusCode.OK
        got = [pb.GetFrame.FromString(f) for f in frames]
        assert [f.data for f in got] == [BLOBS[k][0] for k in keys]
