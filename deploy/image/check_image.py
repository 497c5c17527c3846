"""`make test-image`: build the image, run nopecache-server from it, use it from the host.

    python deploy/image/check_image.py

1. builds deploy/Dockerfile with deploy/image/build.sh (docker, podman or buildah; the
   host's package-index settings as build secrets); no builder: prints why and exits 0
   ("skipped"), so `make test` runs it everywhere;
2. starts ``nopecache-server`` from the image's own filesystem: a container
   (``docker run`` / ``podman run``) where the machine allows one, else a buildah working
   container run under chroot isolation (``buildah run --isolation chroot``: the image's
   root filesystem, its USER and environment, the host's network), on a free loopback port;
3. from the host: waits for the gRPC health service to say SERVING, stores a block with Put
   and fetches it back with Get (byte-identical), runs the image's HEALTHCHECK command
   (``nopecache-healthcheck``) inside it, and checks that the server process runs as the
   image's unprivileged user (uid 10001), not root;
4. stops the server with SIGTERM (exit status 0) and removes what it made: the container,
   the image, and the local base image when this run had to make it.

Prints one line per step and ``test-image: PASS (<how it ran>)`` last; exits 1 on a failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nopecache.proto import cache_pb2 as pb  # noqa: E402
from nopecache.proto import cache_pb2_grpc  # noqa: E402
from tests.support.server_harness import frames_of, key_of, make_block  # noqa: E402

IMAGE = f"localhost/nopecache-test-image:{os.getpid()}"
LOCAL_BASE = "localhost/nopecache-base:bookworm"
UID = 10001
STORAGE = ["--storage-driver", os.environ.get("BUILDAH_STORAGE_DRIVER", "vfs")]
# Hang guards, not timings: the server is SERVING ~2 s after start on an idle machine (it
# imports torch); a loaded 2-core machine may take many times that.
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0


def say(line: str) -> None:
    print(f"test-image: {line}", flush=True)


def run(
    cmd: Sequence[str], *, check: bool = False, timeout: float | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``; its output captured as text."""
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_serving(address: str, proc: subprocess.Popen[bytes]) -> None:
    """Until the health service at ``address`` says SERVING (the process must stay up)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode} before serving")
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{address} not SERVING after {START_TIMEOUT_S:.0f} s")
            time.sleep(0.2)


def round_trip(address: str) -> None:
    """Put one block and Get it back, byte for byte."""
    key = key_of(2027)
    blob = make_block(key, tokens=16, head_dim=64)
    with grpc.insecure_channel(address) as channel:
        stub = cache_pb2_grpc.KVCacheStub(channel)
        reply = stub.Put(iter(frames_of([(key, blob)], 64 * 1024)), timeout=30)
        outcomes = [r.outcome for r in reply.results]
        if outcomes != [pb.PUT_OUTCOME_STORED]:
            raise RuntimeError(f"Put answered {reply}")
        data = b"".join(f.data for f in stub.Get(pb.GetRequest(keys=key), timeout=30))
    if data != blob:
        raise RuntimeError(f"Get returned {len(data)} bytes, not the {len(blob)} stored")


def server_uids(port: int) -> list[int]:
    """The real uids of the processes serving ``port`` (found by their environment)."""
    uids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            environ = (status.parent / "environ").read_bytes().split(b"\0")
            cmdline = (status.parent / "cmdline").read_bytes()
            text = status.read_text()
        except OSError:
            continue
        if f"NOPECACHE_PORT={port}".encode() in environ and b"nopecache-server" in cmdline:
            uid_line = next(line for line in text.splitlines() if line.startswith("Uid:"))
            uids.append(int(uid_line.split()[1]))
    return uids


class BuildahRun:
    """nopecache-server in a buildah working container under chroot isolation."""

    how = "buildah working container, chroot isolation, host network"

    def __init__(self, port: int) -> None:
        self.port = port
        self.ctr = run(["buildah", *STORAGE, "from", IMAGE], check=True).stdout.strip()
        env = {"NOPECACHE_HOST": "127.0.0.1", "NOPECACHE_PORT": str(port), "NOPECACHE_METRICS": "0"}
        config = ["buildah", *STORAGE, "config"]
        for name, value in env.items():
            config += ["--env", f"{name}={value}"]
        run([*config, self.ctr], check=True)
        self.proc = subprocess.Popen(
            self._run("nopecache-server", "--tier", "cpu://?capacity=64MiB&pinned=no"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )

    def _run(self, *cmd: str) -> list[str]:
        isolation = os.environ.get("BUILDAH_ISOLATION", "chroot")
        return ["buildah", *STORAGE, "run", "--isolation", isolation, self.ctr, "--", *cmd]

    def exec(self, *cmd: str) -> subprocess.CompletedProcess[str]:
        return run(self._run(*cmd), timeout=120)

    def stop(self) -> int:
        # SIGTERM to the server itself (buildah run forwards no signal under chroot).
        for pid in _pids(self.port):
            os.kill(pid, signal.SIGTERM)
        return self.proc.wait(timeout=STOP_TIMEOUT_S)

    def remove(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        run(["buildah", *STORAGE, "rm", self.ctr])


def _pids(port: int) -> list[int]:
    out = []
    for status in Path("/proc").glob("[0-9]*/environ"):
        try:
            environ = status.read_bytes().split(b"\0")
            cmdline = (status.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if f"NOPECACHE_PORT={port}".encode() in environ and b"nopecache-server" in cmdline:
            out.append(int(status.parent.name))
    return out


class ContainerRun:
    """nopecache-server in a container (docker or podman run), its port published on loopback."""

    def __init__(self, tool: str, port: int) -> None:
        self.tool, self.port = tool, port
        self.how = f"{tool} run, port published on 127.0.0.1"
        self.name = f"nopecache-test-image-{os.getpid()}"
        env = ["-e", f"NOPECACHE_PORT={port}", "-e", "NOPECACHE_METRICS=0"]
        self.proc = subprocess.Popen(
            [
                tool,
                "run",
                "--rm",
                "--name",
                self.name,
                "-p",
                f"127.0.0.1:{port}:{port}",
                *env,
                IMAGE,
                "--tier",
                "cpu://?capacity=64MiB&pinned=no",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )

    def exec(self, *cmd: str) -> subprocess.CompletedProcess[str]:
        return run([self.tool, "exec", self.name, *cmd], timeout=120)

    def uids(self) -> list[int]:
        top = run([self.tool, "exec", self.name, "id", "-u"], timeout=60).stdout.split()
        return [int(u) for u in top]

    def stop(self) -> int:
        run([self.tool, "kill", "--signal", "TERM", self.name], timeout=60)
        return self.proc.wait(timeout=STOP_TIMEOUT_S)

    def remove(self) -> None:
        run([self.tool, "rm", "-f", self.name], timeout=60)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _builder() -> str:
    """The builder build.sh picks (the same probe order)."""
    forced = os.environ.get("BUILDER")
    if forced:
        return forced
    for tool, probe in (("docker", ["docker", "info"]), ("podman", ["podman", "info"])):
        if shutil.which(tool) and run(probe, timeout=60).returncode == 0:
            return tool
    return "buildah"


def main() -> int:
    builder = _builder()
    # "buildah" is also the fallback when nothing works: then it may not be installed at all,
    # and build.sh says so (exit 3, a skip) rather than this probe raising.
    had_base = (
        builder != "buildah"
        or shutil.which("buildah") is None
        or run(["buildah", *STORAGE, "inspect", LOCAL_BASE]).returncode == 0
    )
    build = subprocess.run([str(ROOT / "deploy/image/build.sh"), IMAGE], text=True)
    if build.returncode == 3:
        say("SKIPPED: no image builder works on this machine (see the lines above)")
        return 0
    if build.returncode != 0:
        say(f"FAIL: the image build failed (exit {build.returncode})")
        return 1
    say(f"built {IMAGE} with {builder}")
    port = free_port()
    server: BuildahRun | ContainerRun = (
        BuildahRun(port) if builder == "buildah" else ContainerRun(builder, port)
    )
    failed = ""
    try:
        address = f"127.0.0.1:{port}"
        wait_serving(address, server.proc)
        say(f"server from the image SERVING on {address} ({server.how})")
        round_trip(address)
        say("Put and Get of a block from the host: byte-identical")
        probe = server.exec("nopecache-healthcheck")
        if probe.returncode != 0:
            raise RuntimeError(f"nopecache-healthcheck exited {probe.returncode}: {probe.stderr}")
        say(f"HEALTHCHECK command in the image: exit 0 ({probe.stderr.strip()})")
        uids = server_uids(port) if isinstance(server, BuildahRun) else server.uids()
        if not uids or set(uids) != {UID}:
            raise RuntimeError(f"server process uids {uids}, expected only {UID}")
        say(f"server process runs as uid {UID} (not root)")
        code = server.stop()
        if code != 0:
            raise RuntimeError(f"the server exited {code} after SIGTERM")
        say("SIGTERM: exit status 0")
    except Exception as e:  # report, then clean up whatever happened
        failed = str(e)
        if server.proc.stdout is not None and server.proc.poll() is not None:
            sys.stdout.write(server.proc.stdout.read().decode(errors="replace")[-3000:])
    finally:
        server.remove()
        if builder == "buildah":
            run(["buildah", *STORAGE, "rmi", IMAGE])
        else:
            run([builder, "rmi", IMAGE])
        if not had_base:
            run(["buildah", *STORAGE, "rmi", LOCAL_BASE])
        say("removed the container and the image" + ("" if had_base else " and the base"))
    if failed:
        say(f"FAIL: {failed}")
        return 1
    say(f"PASS ({server.how})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
