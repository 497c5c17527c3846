"""Progress, not silence: the minimum rate of a stream that holds in-flight budget.

A stream holding a share of the in-flight budget (inflight.py: a Put's blocks, a Get's
window, a bulk block being sent) keeps others from that room for as long as it lives.
Cutting streams only for *silence* hurts honest slow clients (a loaded machine stalls a
sender for a second now and then) and misses dishonest ones (one byte every half second
is never silent). So what a holding stream owes is *progress*, measured only while the
server waits for its peer (time the server spends on its own work is not the peer's)::

    window rule   over each ``window_s`` of waiting for the peer, the peer moved at
                  least ``min_rate`` bytes per second waited; checked when a wait ends or
                  the peer makes progress (a drip of one byte every 0.5 s is cut once
                  ``window_s`` of waiting has passed)
    wait bound    one wait for the peer lasts at most ``window_s`` when every byte the
                  peer moves is seen (bulk sockets: bytes received, bytes acknowledged),
                  or ``expect / min_rate + window_s`` when the peer's bytes are seen only
                  as a whole message of up to ``expect`` bytes (a gRPC frame)
    block bound   a block announced with ``size`` bytes is complete within
                  ``size / min_rate + window_s`` of its first byte

A stream that holds nothing is not judged here (the lease's silence timer,
``stream_idle_timeout_s``, bounds its waits). Streams that wait for the peer's whole
message give the peer the benefit of a message at the minimum rate: gRPC shows no
progress inside a message.

:class:`ProgressWatch` is the per-stream state; it runs on the event loop and calls its
``on_cut`` once with the :class:`CutReason` that ended the stream.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from dataclasses import dataclass

from nopecache.proto.sizes import format_size

__all__ = ["CutReason", "ProgressRule", "ProgressWatch"]

# Timers fire a hair early or late; a window counts as full this close to it.
_EPSILON_S = 1e-3


class CutReason(enum.Enum):
    """Why a watched stream was cut."""

    BELOW_RATE = "below_rate"  # the window rule
    WAIT_BOUND = "wait_bound"  # one wait outlasted its bound
    BLOCK_BOUND = "block_bound"  # a block outlasted its size at the minimum rate
    RECLAIMED = "reclaimed"  # silent for a window while others waited for its room


@dataclass(frozen=True, slots=True)
class ProgressRule:
    """The minimum rate (bytes per second) and the window it is measured over."""

    min_rate: int
    window_s: float

    def __post_init__(self) -> None:
        if self.min_rate <= 0:
            raise ValueError(f"min_rate: must be > 0 bytes/s, got {self.min_rate}")
        if not self.window_s > 0:
            raise ValueError(f"window_s: must be > 0, got {self.window_s}")

    def seconds_for(self, n: int) -> float:
        """How long ``n`` bytes may take at the minimum rate, the window's grace added."""
        return n / self.min_rate + self.window_s

    @property
    def rate_text(self) -> str:
        """The rate as an operator writes it (``64KiB/s``)."""
        return f"{format_size(self.min_rate)}/s"


class ProgressWatch:
    """The progress of one stream (module docstring); ``holding()`` says whether the
    stream holds budget now, ``on_cut`` is called once when it falls behind."""

    __slots__ = (
        "_block_by",
        "_expect",
        "_holding",
        "_moved",
        "_on_cut",
        "_rule",
        "_since",
        "_timer",
        "_wait_from",
        "_waited",
        "cut",
        "cut_in_frame",
        "moved_total",
    )

    def __init__(
        self,
        rule: ProgressRule,
        holding: Callable[[], bool],
        on_cut: Callable[[CutReason], None],
    ) -> None:
        self._rule = rule
        self._holding = holding
        self._on_cut = on_cut
        self._moved = 0  # bytes the peer moved in the current window
        self._waited = 0.0  # seconds waited for the peer (holding) in the current window
        self._wait_from: float | None = None  # accounted up to here in the current wait
        self._since: float | None = None  # the current wait's last progress
        self._expect: int | None = None  # the current wait: a whole message of this size
        self._block_by: float | None = None  # the open block's bound
        self._timer: asyncio.TimerHandle | None = None
        self.cut: CutReason | None = None
        self.cut_in_frame = False  # cut waiting for a whole message (gRPC frame)
        self.moved_total = 0

    @property
    def rule(self) -> ProgressRule:
        """The rule this stream is held to."""
        return self._rule

    def silent_for(self, now: float) -> float:
        """Seconds since the current wait's last progress (0 when not waiting)."""
        return 0.0 if self._since is None else now - self._since

    # -- the stream's events -------------------------------------------------------------
    def begin_wait(self, expect: int | None = None) -> None:
        """The server waits for the peer: each byte it moves is seen (``progress``), or,
        with ``expect``, only a whole message of up to ``expect`` bytes at the end."""
        now = asyncio.get_running_loop().time()
        self._since = self._wait_from = now
        self._expect = expect
        self._arm()

    def progress(self, n: int) -> None:
        """The peer moved ``n`` bytes during the current wait (which goes on)."""
        if n <= 0:
            return
        now = asyncio.get_running_loop().time()
        self._account(now)
        self._moved += n
        self.moved_total += n
        if self._since is not None:
            self._since = now
        self._judge()

    def end_wait(self, n: int = 0) -> None:
        """The wait is over; the peer moved ``n`` bytes in it."""
        now = asyncio.get_running_loop().time()
        self._account(now)
        self._moved += max(0, n)
        self.moved_total += max(0, n)
        self._since = self._wait_from = None
        self._judge()

    def begin_block(self, size: int) -> None:
        """A block of ``size`` bytes opens: it must be complete within its bound."""
        self._block_by = asyncio.get_running_loop().time() + self._rule.seconds_for(size)
        self._arm()

    def end_block(self) -> None:
        """The open block is complete."""
        self._block_by = None

    def close(self) -> None:
        """Stop watching."""
        self._since = self._wait_from = None
        self._block_by = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def reclaim(self, now: float) -> bool:
        """Cut the stream if it holds budget and its current wait saw no progress for a
        window (called when other streams wait for room); whether it was cut."""
        if self.cut is None and self._holding() and self.silent_for(now) >= self._rule.window_s:
            self._fire(CutReason.RECLAIMED)
            return True
        return False

    # -- the rules ----------------------------------------------------------------------
    def _account(self, now: float) -> None:
        """Add the current wait's time since it was last accounted, if holding."""
        if self._wait_from is not None:
            if self._holding():
                self._waited += now - self._wait_from
            self._wait_from = now

    def _judge(self) -> None:
        """The window rule, once a window of waiting is accounted."""
        if self.cut is not None or self._waited < self._rule.window_s - _EPSILON_S:
            return
        if self._moved < self._rule.min_rate * self._waited:
            self._fire(CutReason.BELOW_RATE)
            return
        self._moved, self._waited = 0, 0.0

    def _deadline(self) -> float | None:
        """When the current wait or the open block runs out (None: nothing to bound)."""
        bound: float | None = None
        if self._since is not None and self._holding():
            rule = self._rule
            if self._expect is None:
                # No byte for a window, or the window rule falling due inside the wait.
                wait_s = min(rule.window_s, max(rule.window_s - self._waited, 0.0))
            else:
                wait_s = rule.seconds_for(self._expect)
            bound = self._since + wait_s
        if self._block_by is not None:
            bound = self._block_by if bound is None else min(bound, self._block_by)
        return bound

    def _arm(self) -> None:
        deadline = self._deadline()
        if deadline is None:
            return
        timer = self._timer
        if timer is not None:
            if timer.when() <= deadline:
                return  # fires first; _check re-arms for the rest
            timer.cancel()
        self._timer = asyncio.get_running_loop().call_at(deadline, self._check)

    def _check(self) -> None:
        self._timer = None
        if self.cut is not None:
            return
        now = asyncio.get_running_loop().time()
        if self._block_by is not None and now >= self._block_by:
            self._fire(CutReason.BLOCK_BOUND)
            return
        if self._expect is None:  # inside a whole-message wait nothing is judged early
            self._account(now)
            self._judge()
            if self.cut is not None:
                return
        if self._since is not None and self._holding():
            rule = self._rule
            bound_s = rule.window_s if self._expect is None else rule.seconds_for(self._expect)
            if now - self._since >= bound_s - _EPSILON_S:
                self._fire(CutReason.WAIT_BOUND)
                return
        deadline = self._deadline()
        if deadline is None:
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_at(max(deadline, now + _EPSILON_S), self._check)

    def _fire(self, reason: CutReason) -> None:
        self.cut = reason
        self.cut_in_frame = self._since is not None and self._expect is not None
        self.close()
        self._on_cut(reason)
