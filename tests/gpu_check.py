"""``make gpu-check``: every GPU test, then the kernel benchmark, then one summary line.

Runs as it is on a machine with a CUDA device and an image that has torch, triton and
pytest (nothing installed, no network): when ``nopecache`` is not installed, a temporary
tree of symlinks maps ``nopecache.<folder>`` onto this checkout (the layout pyproject.toml
installs). Test files whose other dependencies (grpc, msgpack, ...) are missing skip
themselves and the summary counts them; conftest.py is not loaded (it needs hypothesis
and the server fixtures' imports), which the GPU tests do not use.

Steps: every test marked ``gpu`` in the files that have any; ``bench/kernels.py --sweep``;
then the last line::

    GPU-CHECK status=ok device=... gpus=1 passed=... failed=0 errors=0 skipped=... RESULT ...

``status`` is ``ok`` only when no test failed or errored and the benchmark printed its
RESULT line. Exit status 0 with ``status=ok``, else 1.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    """The environment for the children: the checkout importable, no interpreter mode."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # The folder is the import name: the checkout's root makes nopecache and tests importable.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _gpu_test_files() -> list[str]:
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if "mark.gpu" in p.read_text()
    )


def _counts(junit: Path) -> dict[str, int]:
    if not junit.exists():
        return {"passed": 0, "failed": 0, "errors": 1, "skipped": 0}
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors")}
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    return {
        "passed": total["tests"] - total["failures"] - total["errors"] - skipped,
        "failed": total["failures"],
        "errors": total["errors"],
        "skipped": skipped,
    }


def main() -> int:
    """Run the tests and the benchmark; print the summary line last."""
    import torch

    if not torch.cuda.is_available():
        print("GPU-CHECK status=no-gpu (torch.cuda.is_available() is False)")
        return 1
    device = torch.cuda.get_device_name(0).replace(" ", "_")
    gpus = torch.cuda.device_count()
    import triton

    print(f"torch {torch.__version__}, triton {triton.__version__}, {gpus} x {device}", flush=True)
    with tempfile.TemporaryDirectory(prefix="nopecache-gpu-check-") as tmp_name:
        tmp = Path(tmp_name)
        env = _env()
        junit = tmp / "junit.xml"
        files = _gpu_test_files()
        tests = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-m",
                "gpu",
                "--noconftest",
                "-p",
                "no:cacheprovider",
                "-q",
                "-rfEs",
                f"--junitxml={junit}",
                *files,
            ],
            cwd=ROOT,
            env=env,
            check=False,
        )
        counts = _counts(junit)
        bench = subprocess.run(
            [sys.executable, "bench/kernels.py", "--sweep"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    print(bench.stdout, end="", flush=True)
    if bench.returncode:
        print(bench.stderr[-3000:], flush=True)
    lines = bench.stdout.strip().splitlines()
    result = lines[-1] if lines and lines[-1].startswith("RESULT ") else "RESULT missing"
    ok = (
        tests.returncode == 0
        and counts["failed"] == counts["errors"] == 0
        and counts["passed"] > 0
        and result != "RESULT missing"
    )
    summary = " ".join(f"{k}={v}" for k, v in counts.items())
    print(
        f"GPU-CHECK status={'ok' if ok else 'FAILED'} device={device} gpus={gpus} "
        f"{summary} {result}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
