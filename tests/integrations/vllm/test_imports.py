"""The connector's modules other than the facade import without vLLM.

The halves are unit-tested in the main environment, which has no vLLM; this pins that
none of them (nor ``compat``, which reaches into vLLM only inside its functions) starts
importing it. A child interpreter blocks every ``vllm`` import, so the check does not
depend on what this environment has installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

WITHOUT_VLLM = (
    "blend",
    "blend_loop",
    "compat",
    "config",
    "errors",
    "gate",
    "layout",
    "metadata",
    "plain",
    "quality",
    "scheduler",
    "worker",
)

_CHILD = """
import importlib, importlib.abc, json, sys

class NoVllm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"vllm is blocked here ({name})", name=name)
        return None

sys.meta_path.insert(0, NoVllm())
out = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(f"nopecache.integrations.vllm.{name}")
        out[name] = "ok"
    except ModuleNotFoundError as err:
        out[name] = f"needs {err.name}"
out["vllm loaded"] = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
print(json.dumps(out))
"""


def _import_without_vllm(*modules: str) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, *modules],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_the_halves_and_their_modules_import_without_vllm() -> None:
    result = _import_without_vllm(*WITHOUT_VLLM)
    assert result == {**dict.fromkeys(WITHOUT_VLLM, "ok"), "vllm loaded": []}


def test_the_facade_and_metrics_need_vllm() -> None:
    # The blocker works: the two modules built on vLLM's connector API fail under it.
    result = _import_without_vllm("connector", "metrics")
    assert result == {
        "connector": "needs vllm",
        "metrics": "needs vllm",
        "vllm loaded": [],
    }
