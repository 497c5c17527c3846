"""One suite at a time on this machine: a lock taken by pytest hooks, outside any test.

The real-vLLM suite starts engines of ~2 GiB each, so two suites (two checkouts' ``make
test`` side by side) take turns. The wait happens in ``pytest_collection_finish``, not in a
fixture: a fixture's wait would count against the first test's ``timeout`` (300 s), and a
suite queued behind another (~10 minutes) would fail while waiting for its turn.

A conftest names the two hooks::

    pytest_collection_finish = suite_lock.hold
    pytest_sessionfinish = suite_lock.release
"""

from __future__ import annotations

import fcntl
import sys
import time
from typing import IO

import pytest

VLLM_LOCK = "/tmp/nopecache-vllm-tests.lock"

_held: dict[str, IO[str]] = {}


def acquire(path: str) -> IO[str]:
    """Block until this process holds ``path``'s exclusive lock; say so if it had to wait."""
    handle = open(path, "w")  # noqa: SIM115 - held until release(), across hooks
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        started = time.monotonic()
        print(f"\nwaiting for {path}: another suite holds it", file=sys.stderr, flush=True)
        fcntl.flock(handle, fcntl.LOCK_EX)
        waited = time.monotonic() - started
        print(f"got {path} after {waited:.0f} s", file=sys.stderr, flush=True)
    return handle


def hold(session: pytest.Session) -> None:
    """``pytest_collection_finish``: take the vLLM suite lock before the first test."""
    if session.items and VLLM_LOCK not in _held:
        _held[VLLM_LOCK] = acquire(VLLM_LOCK)


def release(session: pytest.Session, exitstatus: int) -> None:
    """``pytest_sessionfinish``: let the next suite in."""
    handle = _held.pop(VLLM_LOCK, None)
    if handle is not None:
        handle.close()
