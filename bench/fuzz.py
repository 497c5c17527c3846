"""Wire fuzzer, time-bounded: random and mutated requests against a real server process.

The long-running twin of ``tests/cache_server/test_fuzz.py`` (hypothesis, a few hundred inputs). Here a
seeded ``random.Random`` drives, for ``--seconds``:

* mutated valid messages (Lookup/Get/Delete/Stats requests, Put streams of real blocks)
  with byte flips, insertions, deletions, truncations, duplicated chunks, mislabelled keys
  and wrong sizes, split into frames anyhow;
* raw garbage bytes to every method, and to a method that does not exist;
* every authorization variant: two tenants' tokens, none, a wrong one, a malformed one.

After each input it checks that the status is a defined one (never UNKNOWN, INTERNAL, or
a hang), that the server process is alive (a dead one is counted as a crash, restarted
and re-seeded), and that a digest of everything stored (Get of every known key for both
tenants, plus tier occupancy) moved only when the reply says a block was stored or
deleted. Loopback only; the server runs with auth, a per-tenant quota and small limits.

Last line: ``RESULT inputs=... crashes=0 undefined_statuses=0 digest_violations=0 ...``.
"""

from __future__ import annotations

import argparse
import collections
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
import xxhash

from nopecache.proto import cache_pb2 as pb
from nopecache.proto.block import StoredForm, build_block
from tests.support.ready import wait_serving

# The RESULT line's keys, in order: tests/bench/test_quick.py checks a --quick run
# prints exactly these.
RESULT_KEYS = (
    "inputs",
    "crashes",
    "undefined_statuses",
    "digest_violations",
    "inputs_per_s",
)

SERVICE = "/nopecache.v1.KVCache/"
# --quick: a count, not a time, so a quick run makes the same inputs on a fast machine as
# on a loaded one (a few seconds either way).
QUICK_INPUTS = 150
ALICE = "alice-token-7f3a9c1e5b2d4068"
BOB = "bob-token-2c8e6a4f1d3b5079"
AUTHORIZATIONS = [
    f"Bearer {ALICE}",
    f"Bearer {BOB}",
    f"Bearer {ALICE}",
    f"Bearer {BOB}",
    None,
    f"Bearer {ALICE[:-1]}Z",
    f"Basic {ALICE}",
    "Bearer",
]
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
MAX_MESSAGE = 64 * 1024
POOL = [xxhash.xxh3_128_digest(i.to_bytes(8, "little")) for i in range(24)]
SEEDS = {ALICE: POOL[:4], BOB: POOL[4:8]}
FREE = POOL[8:]


def make_block(key: bytes, tokens: int, head_dim: int) -> bytes:
    """A valid float16 block for ``key``."""
    payload = (key * (4 * tokens * head_dim // 16 + 1))[: 4 * tokens * head_dim]
    return build_block(
        key=key,
        fingerprint=b"fuzz-model",
        form=StoredForm.NOPE,
        dtype="float16",
        shape=(1, tokens, 1, head_dim),
        v_head_dim=head_dim,
        token_ids=list(range(tokens)),
        payload=payload,
    )


BLOBS = {k: [make_block(k, 4, 8), make_block(k, 40, 32), make_block(k, 300, 64)] for k in POOL}


def mutate(data: bytes, rng: random.Random) -> bytes:
    """``data`` with one to four random edits."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        at = rng.randrange(len(out) + 1)
        if op == 0 and out:
            out[min(at, len(out) - 1)] ^= rng.randint(1, 255)
        elif op == 1:
            out[at:at] = rng.randbytes(rng.randint(1, 16))
        elif op == 2:
            del out[at : at + rng.randint(1, 16)]
        elif op == 3:
            del out[at:]
        elif op == 4 and out:
            start = rng.randrange(len(out))
            out[at:at] = out[start : start + rng.randint(1, 64)]
        else:
            out[at:at] = bytes([rng.choice([0x08, 0x0A, 0x10, 0x1A, 0x22, 0xFF])])
    return bytes(out)


class Target:
    """A server process on a fixed loopback port, restarted when it dies."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        tokens = workdir / "tokens"
        tokens.write_text(f"{ALICE} alice\n{BOB} bob\n")
        self.command = [
            sys.executable,
            *("-m", "nopecache.cache_server", "--host", "127.0.0.1", "--port", str(self.port)),
            *("--no-metrics", "--tier", "cpu://?capacity=8MiB&page=4KiB&pinned=no"),
            *("--auth-tokens-file", str(tokens), "--tenant-quota", "256KiB"),
            *("--max-message-bytes", str(MAX_MESSAGE), "--max-block-bytes", "256KiB"),
            *("--max-request-bytes", "1MiB", "--max-keys-per-request", str(MAX_KEYS)),
            *("--log-level", "WARNING"),
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self.channel: grpc.Channel | None = None
        self.baseline = b""

    def start(self) -> None:
        """Start the server, wait for SERVING, store the seed blocks."""
        log = (self.workdir / "server.log").open("ab")
        self.proc = subprocess.Popen(self.command, stdout=log, stderr=log)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        # An exit is reported at once (code and log lines); the bound is a hang guard only.
        wait_serving(
            self.proc,
            f"127.0.0.1:{self.port}",
            self.workdir / "server.log",
            timeout_s=600.0,
            service="nopecache.v1.KVCache",
        )
        for token, keys in SEEDS.items():
            frames = [
                pb.PutFrame(
                    key=k, total_size=len(BLOBS[k][0]), data=BLOBS[k][0]
                ).SerializeToString()
                for k in keys
            ]
            code, _ = self.call("Put", frames, f"Bearer {token}")
            assert code == grpc.StatusCode.OK, code
        self.baseline = self.digest()

    def alive(self) -> bool:
        """Whether the server process runs."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Kill the server."""
        if self.channel is not None:
            self.channel.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def call(
        self, method: str, payload: bytes | Sequence[bytes], authorization: str | None
    ) -> tuple[grpc.StatusCode, list[bytes]]:
        """Raw request bytes in (a list for Put), status and raw replies out."""
        assert self.channel is not None
        metadata: tuple[tuple[str, str | bytes], ...] | None = (
            (("authorization", authorization),) if authorization else None
        )
        path = SERVICE + method
        try:
            if method == "Put":
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
            request = pb.GetRequest(keys=b"".join(POOL)).SerializeToString()
            code, frames = self.call("Get", request, f"Bearer {token}")
            assert code == grpc.StatusCode.OK, code
            for raw in frames:
                h.update(raw)
        code, replies = self.call("Stats", b"", f"Bearer {ALICE}")
        assert code == grpc.StatusCode.OK, code
        for t in pb.StatsReply.FromString(replies[0]).tiers:
            h.update(f"{t.name}:{t.used_bytes}:{t.entries};".encode())
        return h.digest()


# -- input generators: each returns (method, payload, may it change what is stored) ----------
Input = tuple[str, bytes | list[bytes], bool]


def _packed_keys(rng: random.Random, with_seeds: bool) -> bytes:
    pool = POOL if with_seeds else FREE
    keys = [
        rng.choice(pool) if rng.random() < 0.7 else rng.randbytes(16)
        for _ in range(rng.randint(0, 12))
    ]
    return b"".join(keys)


def gen_query(rng: random.Random) -> Input:
    """Lookup/Get/Stats, valid or mutated (queries never change anything)."""
    method = rng.choice(["Lookup", "Get", "Stats"])
    keys = _packed_keys(rng, True)
    if method == "Stats":
        raw = pb.StatsRequest().SerializeToString()
    elif method == "Lookup":
        raw = pb.LookupRequest(keys=keys).SerializeToString()
    else:
        raw = pb.GetRequest(keys=keys).SerializeToString()
    if rng.random() < 0.3:
        raw += rng.choice(POOL) * rng.randint(1, 80)  # maybe over max_keys_per_request
    return method, mutate(raw, rng) if rng.random() < 0.5 else raw, False


def gen_delete(rng: random.Random) -> Input:
    """A valid Delete of free keys, or an invalid one that names the seeds."""
    if rng.random() < 0.4:
        return "Delete", pb.DeleteRequest(keys=_packed_keys(rng, False)).SerializeToString(), True
    seeds = b"".join(rng.sample(POOL[:8], rng.randint(1, 8)))
    over = seeds * (MAX_KEYS // (len(seeds) // 16) + 1)  # past max_keys_per_request
    bad = seeds + rng.randbytes(rng.randint(1, 15)) if rng.random() < 0.5 else over
    return "Delete", pb.DeleteRequest(keys=bad).SerializeToString(), False


def gen_put(rng: random.Random) -> Input:
    """A Put stream of real blocks, some mutated, mislabelled or split oddly."""
    frames: list[bytes] = []
    for _ in range(rng.randint(0, 5)):
        key = rng.choice(POOL)
        blob = rng.choice(BLOBS[key])
        if rng.random() < 0.5:
            blob = mutate(blob, rng)
        label = key if rng.random() < 0.8 else rng.choice([b"", rng.randbytes(16), key[:15]])
        size = len(blob) if rng.random() < 0.85 else rng.choice([0, len(blob) + 1, 2**64 - 1])
        step = rng.randint(max(1, len(blob) // 8), max(1, len(blob)))
        parts = [pb.PutFrame(key=label, total_size=size, data=blob[:step])]
        parts += [pb.PutFrame(data=blob[i : i + step]) for i in range(step, len(blob), step)]
        raws = [p.SerializeToString() for p in parts]
        if rng.random() < 0.1:
            i = rng.randrange(len(raws))
            raws[i] = mutate(raws[i], rng)
        frames += raws
    return "Put", frames, True


def gen_garbage(rng: random.Random) -> Input:
    """Random bytes to any method (Put: a few random frames)."""
    methods = ["Lookup", "Get", "Delete", "Stats", "Put", "AttachShm", "DetachShm"]
    method = rng.choice([*methods, "NoSuchMethod"])
    if method == "Put":
        return method, [rng.randbytes(rng.randint(0, 300)) for _ in range(rng.randint(1, 4))], True
    return method, rng.randbytes(rng.randint(0, 300)), False


GENERATORS: list[Callable[[random.Random], Input]] = [
    gen_query,
    gen_delete,
    gen_put,
    gen_put,
    gen_garbage,
]


def changed_for_real(method: str, code: grpc.StatusCode, replies: list[bytes]) -> bool:
    """Whether the reply says a block was stored or deleted."""
    if code != grpc.StatusCode.OK:
        return False
    if method == "Put":
        results = pb.PutReply.FromString(replies[0]).results
        return any(r.outcome == pb.PUT_OUTCOME_STORED for r in results)
    if method == "Delete":
        return pb.DeleteReply.FromString(replies[0]).deleted > 0
    return False


def main(argv: Sequence[str] | None = None) -> int:
    """Run the fuzzer; print a summary and the RESULT line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="time budget (default 60)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--inputs", type=int, default=0, help="stop after this many inputs (default 0: none)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a smoke run: the first {QUICK_INPUTS} inputs of the seed (the same on any machine)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.inputs = args.inputs or QUICK_INPUTS
    rng = random.Random(args.seed)
    statuses: collections.Counter[str] = collections.Counter()
    inputs = crashes = undefined = violations = 0
    with tempfile.TemporaryDirectory(prefix="nopecache-fuzz-") as tmp:
        target = Target(Path(tmp))
        target.start()
        started = time.monotonic()
        try:
            while time.monotonic() - started < args.seconds and not (
                args.inputs and inputs >= args.inputs
            ):
                method, payload, may_change = rng.choice(GENERATORS)(rng)
                authorization = rng.choice(AUTHORIZATIONS)
                code, replies = target.call(method, payload, authorization)
                inputs += 1
                statuses[f"{method}:{code.name}"] += 1
                if not target.alive():
                    crashes += 1
                    print(f"CRASH on {method}: see {Path(tmp) / 'server.log'}", file=sys.stderr)
                    target.stop()
                    target.start()
                    continue
                if code not in DEFINED:
                    undefined += 1
                    print(f"undefined status {code.name} on {method}", file=sys.stderr)
                before, target.baseline = target.baseline, target.digest()
                moved = target.baseline != before
                if moved and not (may_change and changed_for_real(method, code, replies)):
                    violations += 1
                    print(f"digest moved on a refused {method} ({code.name})", file=sys.stderr)
        finally:
            target.stop()
        elapsed = time.monotonic() - started
    for name, n in sorted(statuses.items()):
        print(f"  {name:36} {n}")
    print(
        f"RESULT inputs={inputs} crashes={crashes} undefined_statuses={undefined} "
        f"digest_violations={violations} inputs_per_s={inputs / elapsed:.0f}"
    )
    return 0 if crashes == undefined == violations == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
