"""Running a benchmark's ``--quick`` mode as ``make test`` does, and reading its RESULT line.

Every ``bench/*.py`` declares ``RESULT_KEYS``, the keys its last line carries, in order;
:func:`declared_keys` reads it from the source (a bench imports vLLM, torch or its
siblings, none of which a test should need to import it). :func:`run_quick` runs
``bench/X.py --quick`` in a child with the repository root on ``PYTHONPATH`` and returns
the parsed RESULT line, after checking the exit status and the line's shape.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
# Only a hang guard: the quick runs take seconds (the vLLM ones a few engine starts) on an
# idle machine; 600 s covers a 2-core machine at load ~6, where a timeout would hide the
# bench's own error behind the guard's.
QUICK_TIMEOUT_S = 600.0


ENGINE_PREFIXES = ("vllm_", "sglang_")


def bench_files(vllm: bool) -> list[Path]:
    """The bench entry points (``bench/[!_]*.py``): the vLLM ones, or those of the main
    environment (neither vLLM's nor SGLang's, see :func:`engine_bench_files`)."""
    if vllm:
        return engine_bench_files("vllm_")
    return sorted(p for p in BENCH.glob("[!_]*.py") if not p.name.startswith(ENGINE_PREFIXES))


def engine_bench_files(prefix: str) -> list[Path]:
    """The benches of one engine's environment (``bench/vllm_*.py``, ``bench/sglang_*.py``)."""
    return sorted(BENCH.glob(f"{prefix}*.py"))


def declared_keys(path: Path) -> tuple[str, ...]:
    """The bench's ``RESULT_KEYS``, read from its source without importing it."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "RESULT_KEYS" for t in node.targets
        ):
            keys = ast.literal_eval(node.value)
            assert isinstance(keys, tuple) and all(isinstance(k, str) for k in keys), keys
            return keys
    raise AssertionError(f"{path.name} declares no RESULT_KEYS (the keys of its RESULT line)")


def parse_result(line: str) -> dict[str, str]:
    """``RESULT k=v k=v`` -> {k: v}, in order; AssertionError on any other shape."""
    assert line.startswith("RESULT "), f"the last line is not a RESULT line: {line!r}"
    fields: dict[str, str] = {}
    for pair in line.removeprefix("RESULT ").split():
        key, sep, value = pair.partition("=")
        assert sep and key and value, f"not key=value: {pair!r} in {line!r}"
        assert key not in fields, f"{key} twice in {line!r}"
        fields[key] = value
    return fields


def run_quick(
    path: Path, python: str = sys.executable, env: dict[str, str] | None = None
) -> dict[str, str]:
    """Run ``path --quick``; its RESULT fields (AssertionError with its output otherwise)."""
    child_env = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [python, str(path), "--quick"],
        cwd=ROOT,
        env=child_env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=QUICK_TIMEOUT_S,
    )
    output = f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, f"{path.name} --quick exited with {proc.returncode}\n{output}"
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines, f"{path.name} --quick printed nothing\n{output}"
    return parse_result(lines[-1])
