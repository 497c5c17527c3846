"""A server or engine child that exits before it is ready is reported at once: the error
names the exit code and carries the child's last log line, long before the readiness
bound (here 600 s) would have run out.

The server is real (``python -m nopecache.cache_server``) and exits on its own: it is
given limits it refuses (a client's in-flight share below the largest request), the
misconfiguration that once left ``bench/server.py`` waiting 60 s for a dead server.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from nopecache.cache_server.config import ServerConfig
from tests.support.bench_runs import BENCH
from tests.support.engine_proc import EngineConfig, EngineError, EngineExited, EngineProc
from tests.support.ready import ProcessExited
from tests.support.redis_procs import free_ports
from tests.support.server_procs import CacheServerProc, start_cache_servers

# A server refusing its limits exits within its start-up (an interpreter and imports:
# ~1 s idle, several seconds on a loaded 2-core machine); the waits below are bounded by
# 600 s, so finishing under this shows the exit was noticed, not waited out.
PROMPT_S = 120.0
REFUSED = ("--max-request-bytes", "64MiB", "--max-inflight-bytes-per-client", "32MiB")
REFUSAL = "max_inflight_bytes_per_client: 33554432 is below max_request_bytes 67108864"


def _bench_module(name: str) -> ModuleType:
    """bench/<name>.py imported as a module (bench/ on sys.path, as when run)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _assert_reported(err: ProcessExited, began: float) -> None:
    assert time.monotonic() - began < PROMPT_S
    assert err.returncode != 0
    assert f"exited with code {err.returncode} before it was ready" in str(err)
    assert REFUSAL in err.tail.splitlines()[-1]  # the server's last line, verbatim
    assert REFUSAL in str(err)


def test_server_proc_reports_its_exit_at_once(tmp_path: Path) -> None:
    server = CacheServerProc(tmp_path, free_ports(1)[0], extra_args=REFUSED)
    began = time.monotonic()
    with pytest.raises(ProcessExited) as caught:
        server.start(timeout_s=600.0)
    _assert_reported(caught.value, began)
    assert not server.running()


def test_start_cache_servers_does_not_retry_a_refused_configuration(tmp_path: Path) -> None:
    began = time.monotonic()
    with pytest.raises(ProcessExited) as caught:
        start_cache_servers(1, tmp_path, extra_args=REFUSED)
    _assert_reported(caught.value, began)
    # Retries are for a port taken meanwhile; this exit was reported after the first try.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["server0-0"]


def test_bench_harness_server_reports_its_exit_at_once(tmp_path: Path) -> None:
    harness = _bench_module("_harness")
    log = tmp_path / "s.log"
    began = time.monotonic()
    with (
        pytest.raises(ProcessExited) as caught,
        harness.cache_server("not-a-size", log),
    ):
        pytest.fail("the server served with a capacity it cannot parse")
    assert time.monotonic() - began < PROMPT_S
    assert caught.value.returncode != 0
    assert "capacity" in caught.value.tail.splitlines()[-1]
    assert caught.value.tail.splitlines()[-1] == log.read_text().strip().splitlines()[-1]


def test_bench_server_limits_are_ones_the_server_accepts(tmp_path: Path) -> None:
    """bench/server.py's limits for its largest Put (1 GiB, what the full run once asked
    for) start a real server: the regression that had it exit at start-up."""
    bench = _bench_module("server")
    child = bench.start_cache_server(bench.Wire(), "64MiB", 1024**3, tmp_path)
    try:
        assert child.proc.poll() is None
    finally:
        child.stop()
    defaults = ServerConfig()
    small = bench.server_limits(1024)  # a small run keeps every default
    assert small == [
        *("--max-request-bytes", str(defaults.max_request_bytes)),
        *("--max-inflight-bytes-per-client", str(defaults.max_inflight_bytes_per_client)),
        *("--max-inflight-bytes", str(defaults.max_inflight_bytes)),
    ]


def test_engine_proc_reports_a_failed_start_with_its_exit_code(tmp_path: Path) -> None:
    """Here (the main environment) the child cannot import vLLM: it answers the failure and
    exits; the error carries the answer, the exit code and the log's last line."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is importable here: the child would build an engine")
    engine = EngineProc(EngineConfig(model=str(tmp_path / "no-model")), tmp_path / "e.log")
    began = time.monotonic()
    try:
        with pytest.raises(EngineError) as caught:
            engine.start()
    finally:
        engine.stop()
    assert time.monotonic() - began < PROMPT_S
    message = str(caught.value)
    assert "start-up failed: ModuleNotFoundError: No module named 'vllm'" in message
    assert "(the engine process exited with code 1)" in message
    last = (tmp_path / "e.log").read_text().strip().splitlines()[-1]
    assert last in message


def test_engine_proc_reports_a_silent_exit_with_its_code(tmp_path: Path) -> None:
    """A child that dies without answering (here its interpreter cannot even start: no
    standard library under PYTHONHOME) is reported when its answer pipe closes."""
    config = EngineConfig(model="unused", env={"PYTHONHOME": str(tmp_path / "nothing")})
    engine = EngineProc(config, tmp_path / "e.log")
    began = time.monotonic()
    try:
        with pytest.raises(EngineExited) as caught:
            engine.start()
    finally:
        engine.stop()
    assert time.monotonic() - began < PROMPT_S
    message = str(caught.value)
    assert message.startswith("the engine process exited with code 1:")
    last = (tmp_path / "e.log").read_text().strip().splitlines()[-1]
    assert last in message
