"""Pytest fixtures that run real ``redis-server`` processes (single and 3-master Cluster).

Every server binds 127.0.0.1 on a free port, keeps nothing on disk (``--save ''
--appendonly no``, its own temporary ``--dir``), is ready when it answers PING (a
cluster: when every node reports ``cluster_state:ok``), and is stopped after use.

Fixtures:
    redis_server                  session-wide server (use ``redis_clean`` in tests)
    redis_clean                   the session server, FLUSHALLed before the test
    redis_disposable              a server of the test's own, to kill and restart
    redis_cluster                 session-wide 3-master cluster (``redis_cluster_clean``)
    redis_cluster_clean           the session cluster, every node FLUSHALLed
    redis_cluster_disposable      a cluster of the test's own (kill a master, ...)

No redis-server on PATH is a failure, not a skip: the Makefile's ``redis-server``
target (``apt-get install -y redis-server``) provides it.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

__all__ = ["RedisClusterProcs", "RedisProc", "free_ports"]

# Only a hang guard: redis-server answers PING within milliseconds of its start and the
# waits return then; 60 s covers a 2-core machine loaded several times over.
_START_TIMEOUT_S = 60.0
_INSTALL_HINT = (
    "redis-server/redis-cli not found on PATH. Install them with "
    "`apt-get update && apt-get install -y redis-server` (or `make redis-server`)."
)


def _require_binaries() -> None:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.fail(_INSTALL_HINT, pytrace=False)


def _as_args(options: dict[str, str]) -> tuple[str, ...]:
    """``{"save": ""}`` -> ``("--save", "")``: redis-server command-line options."""
    return tuple(arg for name, value in options.items() for arg in (f"--{name}", value))


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports that were free a moment ago."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class RedisProc:
    """One redis-server process on a fixed loopback port; can be killed and restarted."""

    def __init__(self, workdir: Path, port: int, extra_args: tuple[str, ...] = ()) -> None:
        self.workdir = workdir
        self.port = port
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        """Where the server writes its log."""
        return self.workdir / f"redis-{self.port}.log"

    def client(self) -> redis.Redis:
        """A synchronous client for test setup and inspection."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self) -> None:
        """Start the server and wait until it answers PING."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        options = {
            "port": str(self.port),
            "bind": "127.0.0.1",
            "save": "",
            "appendonly": "no",
            "dir": str(self.workdir),
            "logfile": str(self.log_path),
        }
        cmd = ["redis-server", *_as_args(options), *self.extra_args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + _START_TIMEOUT_S
        client = self.client()
        try:
            while True:
                if self.proc.poll() is not None:
                    _, err = self.proc.communicate()
                    raise RuntimeError(
                        f"redis-server on port {self.port} exited with {self.proc.returncode}: "
                        f"{err.decode(errors='replace')}\n{self._log_tail()}"
                    )
                try:
                    if client.ping():
                        return
                except redis.exceptions.RedisError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not answer PING")
                time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL the server (a crash: no shutdown, connections reset)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM the server and wait for it (SIGKILL after 10 s)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()

    def flushall(self) -> None:
        """Remove every key."""
        with self.client() as client:
            client.flushall()

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"


class RedisClusterProcs:
    """Three redis-server masters joined into one Redis Cluster (no replicas)."""

    def __init__(self, workdir: Path, size: int = 3) -> None:
        ports = free_ports(2 * size)
        self.nodes = []
        for i in range(size):
            node_dir = workdir / f"node{i}"
            options = {
                "cluster-enabled": "yes",
                "cluster-config-file": str(node_dir / "nodes.conf"),
                # The bus port is explicit: the default (port + 10000) may be taken.
                "cluster-port": str(ports[size + i]),
                "cluster-node-timeout": "2000",
            }
            self.nodes.append(RedisProc(node_dir, ports[i], _as_args(options)))

    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:p1,127.0.0.1:p2,...``."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> None:
        """Start the nodes, create the cluster, wait until every node says cluster_state:ok."""
        for node in self.nodes:
            node.start()
        nodes = [f"127.0.0.1:{n.port}" for n in self.nodes]
        create = subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *nodes,
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            timeout=60,
            check=False,
        )
        if create.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {create.stdout!r}")
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not all(self._node_ok(n) for n in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop every node."""
        for node in self.nodes:
            node.stop()

    def flushall(self) -> None:
        """Remove every key on every master."""
        for node in self.nodes:
            node.flushall()

    @staticmethod
    def _node_ok(node: RedisProc) -> bool:
        with node.client() as client:
            info = client.execute_command("CLUSTER INFO")  # parsed into a dict by redis-py
        return info["cluster_state"] == "ok" and int(info["cluster_slots_assigned"]) == 16384


def _started_server(workdir: Path) -> RedisProc:
    """A running server; a port grabbed by another process meanwhile is retried."""
    _require_binaries()
    for attempt in range(3):
        server = RedisProc(workdir / f"try{attempt}", free_ports(1)[0])
        try:
            server.start()
            return server
        except RuntimeError:
            server.kill()
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _started_cluster(workdir: Path) -> RedisClusterProcs:
    """A running cluster; retried on fresh ports if a start fails."""
    _require_binaries()
    for attempt in range(3):
        cluster = RedisClusterProcs(workdir / f"try{attempt}")
        try:
            cluster.start()
            return cluster
        except RuntimeError:
            for node in cluster.nodes:
                node.kill()
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProc]:
    """A redis-server shared by the whole session."""
    server = _started_server(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_clean(redis_server: RedisProc) -> RedisProc:
    """The session redis-server with every key removed."""
    redis_server.flushall()
    return redis_server


@pytest.fixture
def redis_disposable(tmp_path: Path) -> Iterator[RedisProc]:
    """A redis-server owned by one test (kill / restart it freely)."""
    server = _started_server(tmp_path / "redis")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcs]:
    """A 3-master Redis Cluster shared by the whole session."""
    cluster = _started_cluster(tmp_path_factory.mktemp("redis-cluster"))
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_cluster_clean(redis_cluster: RedisClusterProcs) -> RedisClusterProcs:
    """The session cluster with every key removed."""
    redis_cluster.flushall()
    return redis_cluster


@pytest.fixture
def redis_cluster_disposable(tmp_path: Path) -> Iterator[RedisClusterProcs]:
    """A 3-master Redis Cluster owned by one test."""
    cluster = _started_cluster(tmp_path / "redis-cluster")
    yield cluster
    cluster.stop()
