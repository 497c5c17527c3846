"""``nopecache-admin`` run as a console script against real server processes: every verb,
tables and --json, the exit codes, and keys that agree with what the real client stored
(SmolLM2's tokenizer and model config, KV stored through CacheClient)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from nopecache.admin.cli import main
from nopecache.admin.errors import ExitCode
from nopecache.client import CacheClient
from nopecache.client.fingerprint import ModelFingerprint
from nopecache.kernels import RopeSpec
from nopecache.proto.block import StoredForm
from tests.support.local_model import converted_dir, load_model, load_tokenizer
from tests.support.server_procs import CacheServerProc, ServerFactory

ROOT = Path(__file__).resolve().parents[2]
ALICE = "alice-token-7f3a9c1e5b2d4068"
BOB = "bob-token-2c8e6a4f1d3b5079"
ADMIN = "admin-token-5e1d9b7c3a2f4680"
TOKENS = ("--auth-tokens", f"{ALICE} alice; {BOB} bob", "--admin-tokens", ADMIN)
# Small blocks so that a sentence makes several of each kind.
KEYING = "prefix_block_tokens=8&chunk_min_tokens=4&chunk_avg_tokens=12&chunk_max_tokens=16"
TEXT = "The cache keeps the system prompt resident while the agents take turns at the tools."


def console_script() -> list[str]:
    """The installed ``nopecache-admin``; before the environment is reinstalled with this
    checkout's pyproject, the entry point it names, run the way the generated script does."""
    script = Path(sys.executable).parent / "nopecache-admin"
    if script.exists():
        return [str(script)]
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = entry["nopecache-admin"].partition(":")
    return [
        sys.executable,
        "-c",
        f"import sys; from {module} import {function}; sys.exit({function}())",
    ]


def admin(
    server: CacheServerProc | str, *args: str, token: str | None = ADMIN, url_extra: str = ""
) -> subprocess.CompletedProcess[str]:
    """Run ``nopecache-admin`` against ``server`` (its URL carries ``token``)."""
    address = server if isinstance(server, str) else server.address
    query = "&".join(q for q in (KEYING, url_extra, f"token={token}" if token else "") if q)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NOPECACHE_")}
    env["NOPECACHE_CLIENT_URL"] = f"nopecache://{address}?{query}"
    return subprocess.run(
        [*console_script(), *args], capture_output=True, text=True, timeout=120, env=env
    )


class Paths:
    """SmolLM2's converted folders (tests/support/local_model.py converts them once)."""

    def __init__(self) -> None:
        root = converted_dir()
        self.model, self.tokenizer = root / "model", root / "tokenizer"
        if not (self.tokenizer / "tokenizer.json").exists():
            load_tokenizer()
        if not (self.model / "config.json").exists():
            load_model()


_PATHS: list[Paths] = []


def smollm2_paths() -> Paths:
    if not _PATHS:
        _PATHS.append(Paths())
    return _PATHS[0]


def model_args() -> list[str]:
    paths = smollm2_paths()
    return ["--model", str(paths.model), "--tokenizer", str(paths.tokenizer)]


def store_text(server: CacheServerProc, token: str) -> list[int]:
    """Store KV for TEXT through the real client, keyed as the transformers adapter keys
    (the model folder's name and config); the token ids."""
    from tokenizers import Tokenizer

    paths = smollm2_paths()
    tokens: list[int] = (
        Tokenizer.from_file(str(paths.tokenizer / "tokenizer.json")).encode(TEXT).ids
    )
    config = json.loads((paths.model / "config.json").read_text())
    rope = RopeSpec.from_hf_config(config)
    fingerprint = ModelFingerprint.from_rope_spec(
        model=str(paths.model),
        revision="",
        num_layers=config["num_hidden_layers"],
        num_kv_heads=config["num_key_value_heads"],
        dtype=torch.float32,
        form=StoredForm.NOPE,
        rope=rope,
    )
    shape = (config["num_hidden_layers"], len(tokens), config["num_key_value_heads"], 64)
    generator = torch.Generator().manual_seed(0)
    kv = (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
    url = f"nopecache://{server.address}?{KEYING}&token={token}&shm=off"
    with CacheClient(url, fingerprint=fingerprint, rope=rope, v_head_dim=64) as client:
        report = client.store(tokens, kv, 0)
    assert report.failed == 0, report
    return tokens


@pytest.fixture
def server(cache_servers: ServerFactory) -> CacheServerProc:
    (one,) = cache_servers(1, extra_args=TOKENS)
    return one


def lookup_rows(
    server: CacheServerProc, token: str, capsys: pytest.CaptureFixture[str], *extra: str
) -> list[dict[str, object]]:
    """``lookup --json`` of TEXT, run in this process (see run_main)."""
    args = ["--json", "lookup", "--text", TEXT, *model_args(), *extra]
    code, out, err = run_main(server.address, args, token, capsys)
    assert code == 0, err
    rows: list[dict[str, object]] = json.loads(out)["blocks"]
    return rows


def test_lookup_pin_unpin_and_flush_a_stored_prompt(
    server: CacheServerProc, capsys: pytest.CaptureFixture[str]
) -> None:
    tokens = store_text(server, ALICE)
    rows = lookup_rows(server, ALICE, capsys)
    prefix = [r for r in rows if r["kind"] == "prefix"]
    assert [(r["start"], r["end"]) for r in prefix] == [
        (i, i + 8) for i in range(0, len(tokens) - len(tokens) % 8, 8)
    ]
    assert {r["tier"] for r in rows} == {"cpu"}
    assert {r["pin"] for r in rows} == {None}
    # Bob's namespace holds none of them; the admin must say whose.
    assert {r["tier"] for r in lookup_rows(server, BOB, capsys)} == {None}
    assert {r["tier"] for r in lookup_rows(server, ADMIN, capsys, "--tenant", "alice")} == {"cpu"}

    text = admin(server, "lookup", "--text", TEXT, *model_args(), token=ALICE)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0].split() == ["KIND", "TOKENS", "KEY", "TIER", "PIN", "TTL"]
    assert lines[1].split()[:2] == ["prefix", "0-8"]
    assert lines[-1] == f"{len(rows)} of {len(rows)} blocks present"

    pinned = admin(server, "pin", "--text", TEXT, *model_args(), "--hard", token=ALICE)
    assert pinned.returncode == 0, pinned.stderr
    assert pinned.stdout.startswith(
        f"pinned {len(rows)} of {len(rows)} blocks (hard); 0 not stored"
    )
    assert {r["pin"] for r in lookup_rows(server, ALICE, capsys)} == {"hard"}
    soft = admin(server, "--json", "pin", "--tokens", ",".join(map(str, tokens)), "--model",
                 str(smollm2_paths().model), "--ttl", "600", token=ALICE)  # fmt: skip
    assert soft.returncode == 0, soft.stderr
    assert json.loads(soft.stdout) == {
        "pinned": len(rows),
        "missing": 0,
        "kind": "soft",
        "ttl_s": 600.0,
        "pinned_bytes": json.loads(soft.stdout)["pinned_bytes"],
    }
    assert {r["pin"] for r in lookup_rows(server, ALICE, capsys)} == {"soft"}
    unpinned = admin(server, "unpin", "--text", TEXT, *model_args(), token=ALICE)
    assert unpinned.stdout.strip() == f"unpinned {len(rows)} of {len(rows)} blocks"

    flushed = admin(server, "--json", "flush", "--mine", token=ALICE)
    assert flushed.returncode == 0, flushed.stderr
    assert json.loads(flushed.stdout) == {
        "flushed": "own tenant",
        "deleted": len(rows),
        "unpinned": 0,
    }
    assert {r["tier"] for r in lookup_rows(server, ALICE, capsys)} == {None}


def test_stats_quota_and_drain(server: CacheServerProc) -> None:
    store_text(server, ALICE)
    stats = admin(server, "--json", "stats")
    assert stats.returncode == 0, stats.stderr
    doc = json.loads(stats.stdout)
    assert (doc["draining"], doc["in_flight"]) == (False, 0)
    (cpu,) = doc["tiers"]
    by_tenant = {t["tenant"]: t for t in doc["tenants"]}
    assert set(by_tenant) == {"alice", "bob"}
    assert by_tenant["alice"]["entries"] == cpu["entries"] > 0
    assert by_tenant["alice"]["used_bytes"] == cpu["used_bytes"]
    assert by_tenant["bob"]["entries"] == 0
    table = admin(server, "stats")
    lines = table.stdout.splitlines()
    assert lines[0].startswith(f"server {server.address}  version ")
    assert lines[2].split() == [
        "TIER",
        "ENTRIES",
        "USED",
        "CAPACITY",
        "PAGES",
        "HITS",
        "HIT%",
        "EVICTED",
        "OK",
    ]

    quota = admin(server, "quota", "--tenant", "bob", "--set", "1MiB")
    assert quota.returncode == 0, quota.stderr
    assert quota.stdout.splitlines()[1].split() == ["bob", "1MiB", "0B", "0B"]
    mine = admin(server, "--json", "quota", token=BOB)
    assert json.loads(mine.stdout) == {
        "tenants": [{"tenant": "bob", "quota_bytes": 1 << 20, "used_bytes": 0, "pinned_bytes": 0}]
    }

    drained = admin(server, "drain", "--wait")
    assert drained.returncode == 0, drained.stderr
    assert drained.stdout.strip() == (
        f"{server.address}: draining (new Puts refused, readiness NOT_SERVING); idle"
    )
    assert json.loads(admin(server, "--json", "stats").stdout)["draining"] is True


def run_main(
    address: str, args: Sequence[str], token: str, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str, str]:
    """``nopecache-admin`` in this process (its ``main``): (exit code, stdout, stderr).

    The console script runs ``main`` too; the subprocess tests above prove that path, and
    a start of the interpreter per case (torch is imported) would cost ~10 s on a loaded
    machine.
    """
    url = f"nopecache://{address}?{KEYING}&token={token}"
    code = main(["--url", url, *args])
    out, err = capsys.readouterr()
    return code, out, err


ERRORS = [
    (["stats"], "wrong-token-0123456789", ExitCode.AUTH, "AdminStats: UNAUTHENTICATED"),
    (["flush", "--tenant", "bob"], ALICE, ExitCode.AUTH, "acts on its own tenant (alice) only"),
    (["flush", "--tenant", "carol"], ADMIN, ExitCode.NOT_FOUND, "no tenant 'carol'"),
    (["lookup", "--tokens", "1,x"], ADMIN, ExitCode.USAGE, "--tokens: 'x' is not an integer"),
    (["lookup", "--tokens", "1,2"], ADMIN, ExitCode.USAGE, "needs --model DIR"),
    (["pin", "--keys", "00ff", "--hard"], ADMIN, ExitCode.USAGE, "--keys: '00ff'"),
    (["pin", "--keys", "00" * 16, "--ttl", "0"], ADMIN, ExitCode.USAGE, "--ttl: must be > 0"),
    (["lookup", "--text", "hi"], ADMIN, ExitCode.USAGE, "--text: needs --tokenizer DIR"),
    (
        ["lookup", "--text", "hi", "--tokenizer", "/nonexistent"],
        ADMIN,
        ExitCode.NOT_FOUND,
        "--tokenizer: no tokenizer.json in /nonexistent",
    ),
    (["quota", "--set", "1GiB"], ADMIN, ExitCode.USAGE, "quota --set: needs --tenant"),
    (["quota", "--tenant", "bob", "--set", "lots"], ADMIN, ExitCode.USAGE, "--set"),
    (["frobnicate"], ADMIN, ExitCode.USAGE, "invalid choice: 'frobnicate'"),
]


def test_errors_name_the_problem_with_their_exit_code(
    server: CacheServerProc, capsys: pytest.CaptureFixture[str]
) -> None:
    script = admin(server, "drain", token=ALICE)
    assert (script.returncode, script.stdout) == (ExitCode.AUTH, "")
    assert script.stderr == (
        f"nopecache-admin: {server.address}: Drain: PERMISSION_DENIED: drain: needs an admin "
        "token\n"
    )
    for args, token, code, message in ERRORS:
        got = run_main(server.address, args, token, capsys)
        assert got[:2] == (code, ""), (args, got)
        assert got[2].startswith("nopecache-admin: "), (args, got)
        assert message in got[2], (args, got)


def test_a_url_of_several_servers_needs_server(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--url", "nopecache://a:1,b:2", "stats"])
    _, err = capsys.readouterr()
    assert code == ExitCode.USAGE
    assert err == (
        "nopecache-admin: url: names 2 server(s); nopecache-admin acts on one: choose it with "
        "--server HOST:PORT\n"
    )


def test_pin_past_the_quota_is_refused(
    server: CacheServerProc, capsys: pytest.CaptureFixture[str]
) -> None:
    store_text(server, ALICE)
    set_quota = ["quota", "--tenant", "alice", "--set", "4KiB"]
    assert run_main(server.address, set_quota, ADMIN, capsys)[0] == ExitCode.OK
    pin = ["pin", "--text", TEXT, *model_args(), "--hard"]
    code, out, err = run_main(server.address, pin, ALICE, capsys)
    assert (code, out) == (ExitCode.REFUSED, "")
    assert "pinned bytes count against the quota" in err


def test_an_unreachable_server_exits_4() -> None:
    from tests.support.redis_procs import free_ports

    address = f"127.0.0.1:{free_ports(1)[0]}"
    result = admin(address, "--timeout", "2", "stats")
    assert (result.returncode, result.stdout) == (ExitCode.UNAVAILABLE, "")
    assert result.stderr.startswith(f"nopecache-admin: {address}: AdminStats: UNAVAILABLE")
