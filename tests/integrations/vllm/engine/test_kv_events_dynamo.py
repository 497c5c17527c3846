"""KV events through vLLM's own publisher, read by a router-side indexer nobody here wrote.

A real vLLM engine (CPU build, SmolLM2, its own prefix cache off) stores prompts through
the connector and publishes KV events with vLLM's ``kv_events_config`` ZMQ publisher.
Dynamo's standalone KV indexer (``python -m dynamo.indexer`` from ``.venv-dynamo``, set
up by ``make dynamo``) subscribes to it and answers ``/query`` with the tokens each worker
can serve from each tier. It must:

1. report the engine for the stored prefix, at the tier below the GPU (``disk``: where
   Dynamo files the ``STORAGE`` medium), never as GPU-resident;
2. stop reporting it once the server evicted those blocks (other blocks filled its CPU
   tier; the connector follows the server's removal feed);
3. report it again once stored again, and nothing after an Admin Flush (AllBlocksCleared).

vLLM publishes a step's events when the step ends: after a change on the server, a short
request (shorter than a block: it stores nothing) lets the engine step and publish.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from tests.support.engine_proc import EngineConfig, EngineProc
from tests.support.redis_procs import free_ports
from tests.support.server_harness import key_of, make_block
from tests.support.server_procs import CacheServerProc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # a hang guard: an engine start

ROOT = Path(__file__).resolve().parents[4]
DYNAMO_PYTHON = ROOT / ".venv-dynamo" / "bin" / "python"
BLOCK = 128  # vLLM's CPU block size
WORKER = 7
MODEL = "smollm2"
# Hang guards only: an event reaches the indexer within milliseconds on an idle machine.
EVENT_TIMEOUT_S = 120.0
CAPACITY_MIB = 64
JUNK_MIB = 1  # each filler block


def _post(port: int, path: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        json.dumps(body).encode(),
        {"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        text = reply.read().decode()
    return json.loads(text) if text.startswith("{") else text


@pytest.fixture
def indexer(tmp_path: Path) -> Iterator[int]:
    """Dynamo's standalone indexer on a free port (its HTTP port)."""
    if not DYNAMO_PYTHON.is_file():
        pytest.fail("Dynamo's indexer environment is missing: run `make dynamo`")
    (port,) = free_ports(1)
    log = (tmp_path / "indexer.log").open("wb")
    proc = subprocess.Popen(
        [str(DYNAMO_PYTHON), "-m", "dynamo.indexer", "--port", str(port), "--threads", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    try:
        deadline = time.monotonic() + EVENT_TIMEOUT_S  # a hang guard: up in ~1 s when idle
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/workers", timeout=30):
                    break
            except OSError:
                assert proc.poll() is None, (tmp_path / "indexer.log").read_text()
                assert time.monotonic() < deadline, "the indexer did not answer"
                time.sleep(0.2)
        yield port
    finally:
        proc.kill()
        proc.wait()
        log.close()


def _tiers(port: int, tokens: list[int]) -> dict[str, Any]:
    """What the indexer says worker WORKER holds of ``tokens`` (an empty dict: nothing)."""
    reply = _post(port, "/query", {"token_ids": tokens, "model_name": MODEL})
    found: dict[str, Any] = reply["instances"].get(str(WORKER), {})
    return found


def _until(port: int, tokens: list[int], want: dict[str, int], engine: EngineProc) -> None:
    """Let the engine step (a sub-block prompt) until the indexer's answer matches."""
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    got: dict[str, Any] = {}
    while time.monotonic() < deadline:
        got = _tiers(port, tokens)
        if {k: got.get(k, 0) for k in want} == want:
            return
        engine.generate([1, 2, 3], max_tokens=1)
        time.sleep(0.2)
    raise AssertionError(f"the indexer says {got}, expected {want}")


def _fill(address: str) -> None:
    """Store unrelated blocks until the CPU tier evicted everything older."""
    blobs = [(key_of(i), make_block(key_of(i), tokens=1024, head_dim=256)) for i in range(80)]
    assert len(blobs[0][1]) > JUNK_MIB << 20
    with grpc.insecure_channel(address) as channel:
        stub = cache_pb2_grpc.KVCacheStub(channel)
        for key, blob in blobs:  # one block per Put: frames stay under the message size
            frame = 1 << 20
            frames = [pb.PutFrame(key=key, total_size=len(blob), data=blob[:frame])]
            frames += [
                pb.PutFrame(data=blob[i : i + frame]) for i in range(frame, len(blob), frame)
            ]
            stub.Put(iter(frames), timeout=60)


def test_the_indexer_sees_stored_blocks_at_the_lower_tier_until_evicted(
    model_dir: str, tmp_path: Path, indexer: int
) -> None:
    server = CacheServerProc(
        tmp_path, free_ports(1)[0], tiers=(f"cpu://?capacity={CAPACITY_MIB}MiB&pinned=no",)
    )
    server.start()
    endpoint = f"ipc://{tmp_path}/kv-events"
    config = EngineConfig(
        model=model_dir,
        connector={"url": f"nopecache://{server.address}"},
        extra={
            "kv_events_config": {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": endpoint,
            }
        },
    )
    engine = EngineProc(config, tmp_path / "engine.log").start()
    try:
        registered = _post(
            indexer,
            "/register",
            {"instance_id": WORKER, "endpoint": endpoint, "model_name": MODEL, "block_size": BLOCK},
        )
        assert registered == {"status": "ok"}
        doc = " ".join(f"Rule {i}: the night train leaves platform {i % 9}." for i in range(60))
        prompt = engine.chat(
            [{"role": "system", "content": doc}, {"role": "user", "content": "Hi"}]
        )
        whole = (len(prompt) // BLOCK) * BLOCK
        assert whole >= 3 * BLOCK
        engine.generate(prompt, max_tokens=1)
        # 1. At the tier below the GPU (Dynamo counts lower tiers cumulatively).
        _until(
            indexer, prompt, {"gpu": 0, "cpu": 0, "disk": whole, "longest_matched": whole}, engine
        )
        # 2. Evicted on the server: withdrawn.
        _fill(server.address)
        _until(indexer, prompt, {"disk": 0, "longest_matched": 0}, engine)
        # 3. Stored again, then flushed.
        engine.generate(prompt, max_tokens=1)
        _until(indexer, prompt, {"disk": whole}, engine)
        with grpc.insecure_channel(server.address) as channel:
            cache_pb2_grpc.AdminStub(channel).Flush(pb.FlushRequest(), timeout=30)
        _until(indexer, prompt, {"disk": 0, "longest_matched": 0}, engine)
    finally:
        engine.stop()
        server.stop()
