"""Fixtures for the tests that run a real vLLM (CPU build) in the ``.venv-vllm`` environment.

They are collected only where vLLM is importable (``make test`` runs them with
``.venv-vllm/bin/python -m pytest tests/integrations/vllm/engine``); the main environment skips this folder.
The model folder comes from ``$NOPECACHE_VLLM_MODEL`` (``make`` sets it to the output of
``python -m tests.support.local_model``, run in the main environment, which
converts SmolLM2 once).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM tests run in .venv-vllm (make test does)")

from tests.support import suite_lock
from tests.support.engine_proc import EngineConfig, EngineFactory, EngineProc

# A machine-wide lock: each engine takes ~2 GiB, so suites run one at a time. Taken by
# hooks, before the first test, so the wait never counts against a test's timeout.
pytest_collection_finish = suite_lock.hold
pytest_sessionfinish = suite_lock.release


@pytest.fixture(scope="session")
def model_dir() -> str:
    """The SmolLM2 folder vLLM loads (model and tokenizer files side by side)."""
    path = os.environ.get("NOPECACHE_VLLM_MODEL", "")
    if not path or not (Path(path) / "config.json").is_file():
        pytest.fail(
            "NOPECACHE_VLLM_MODEL must name the converted SmolLM2 folder: run the vLLM "
            "tests through `make test` (or set it to the output of "
            "`.venv/bin/python -m tests.support.local_model`)"
        )
    return path


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory, model_dir: str) -> Iterator[EngineFactory]:
    """Start vLLM engine processes (``engines(dtype=..., connector=...)``); all stopped after."""
    started: list[EngineProc] = []
    logs = tmp_path_factory.mktemp("engines")

    def factory(**kwargs: object) -> EngineProc:
        # ``model=`` overrides SmolLM2 (e.g. the tiny Llama of the tensor-parallel tests).
        config = EngineConfig(**{"model": model_dir, **kwargs})  # type: ignore[arg-type,unused-ignore]
        proc = EngineProc(config, logs / f"engine-{len(started)}.log")
        started.append(proc)
        return proc.start()

    yield factory
    for proc in started:
        proc.stop()
