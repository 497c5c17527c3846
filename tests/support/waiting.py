"""Polling for a condition another task or process brings about, for async tests."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


async def wait_until(
    check: Callable[[], bool | Awaitable[bool]],
    timeout_s: float = 5.0,
    interval_s: float = 0.01,
) -> None:
    """Poll ``check`` (plain or async) every ``interval_s`` until it is true; fail after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not await _answer(check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout_s}s")
        await asyncio.sleep(interval_s)


async def _answer(value: bool | Awaitable[bool]) -> bool:
    """The value of a check, awaited when the check is a coroutine function."""
    return await value if inspect.isawaitable(value) else value
