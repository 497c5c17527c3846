"""The consumer's scheduler: look a prompt up again until the blocks a producer named land.

A decode request may arrive before the prefill engine's store reached the servers (the
producer answers as soon as its prefill ends; its store runs in the background). The
scheduler half then runs :func:`wait_for_prefix` on the client's loop instead of a single
lookup: it looks the prompt up, and while the exact prefix found is shorter than the
hand-off's tokens, waits a :class:`Backoff` delay and looks again, until the deadline. The
scheduler treats it as it treats a lookup in flight (vLLM's request waits, the batch
steps) and claims whatever the last plan holds: short of the hand-off, the rest is
recomputed (counted and logged by the scheduler).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

from nopecache.client.plan import ReusePlan

__all__ = ["Backoff", "wait_for_prefix"]


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delays between lookups: ``first_s``, then times ``factor``, at most ``cap_s``."""

    first_s: float = 0.002
    factor: float = 2.0
    cap_s: float = 0.05

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.cap_s or self.factor < 1:
            raise ValueError(f"need 0 < first_s <= cap_s and factor >= 1, got {self}")

    def delays(self) -> Iterator[float]:
        """The successive delays (endless)."""
        delay = self.first_s
        while True:
            yield delay
            delay = min(self.cap_s, delay * self.factor)


async def wait_for_prefix(
    lookup: Callable[[], Awaitable[ReusePlan]],
    need: int,
    deadline: float,
    backoff: Backoff = Backoff(),
) -> ReusePlan:
    """The first plan whose exact prefix covers ``need`` tokens, else the last one looked
    up by ``deadline`` (``time.monotonic()``); ``lookup``'s errors propagate."""
    delays = backoff.delays()
    while True:
        plan = await lookup()
        left = deadline - time.monotonic()
        if plan.prefix_end >= need or left <= 0:
            return plan
        await asyncio.sleep(min(next(delays), left))
