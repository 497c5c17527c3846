"""The examples the README quotes run for real against a server subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.server_procs import CacheServerProc

ROOT = Path(__file__).resolve().parents[2]


def test_engine_loop_example_reuses_moved_document(cache_server: CacheServerProc) -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "engine_loop.py"),
            f"nopecache://{cache_server.address}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "matches RoPE at those positions: True" in out.stdout
    assert "0 exact-prefix + 300 moved tokens reused" in out.stdout
