"""The server-wide budget for block bytes in flight, and the deadlines of slow streams.

What a server holds besides its tiers is the blocks travelling through it: the frames of
Put streams (kept until the stream ends, then stored) and the window of blocks a Get stream
has read from the tiers and is sending. Without a bound, clients that open streams and
never finish them (a Put that stops sending, a Get whose reader stops reading) make the
server hold those bytes for as long as they like, and enough of them exhaust its memory.

:class:`InflightBudget` bounds them::

    total    max_inflight_bytes            all streams of the process together
    share    max_inflight_bytes_per_client one client: its tenant with auth, its
                                           connection (peer) without

Each stream takes a :class:`Lease`. When a Put block's first frame arrives (it gives the
block's size), and before a Get window's blocks are sent, the lease reserves them (whole
blocks: streams each holding part of a block could fill the budget with none able to
finish one); when the budget (or the client's
share) is full the stream *waits* instead of growing, and while it waits it reads no more
frames, so gRPC's flow control pushes back on the sender. A stream ends its lease when it
ends (``close``), releasing everything it reserved.

Deadlines: a stream that holds budget keeps a minimum rate (progress.py: bytes per
second over a window of waiting for its peer, each wait and each block bounded by its
size at that rate); one that falls behind is cut and its room returned. A stream that
holds nothing is cut after ``stream_idle_timeout_s`` of silence, and a reservation that
cannot be had for that long is refused. Cuts end the call with a
:class:`~.refusal.Refusal` (TOO_SLOW for a slow or silent peer, OVER_LIMIT for a full
budget; each codec words it for its wire), and nothing of a cut Put is stored.

Concurrency: one event loop; reservations change only between awaits. Waiters are woken
on every release and re-check, oldest first.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine

from nopecache.cache_server.progress import CutReason, ProgressRule, ProgressWatch
from nopecache.cache_server.refusal import Refusal, RefusalKind, over_limit

__all__ = ["DEFAULT_RULE", "InflightBudget", "Lease"]

# Read credits of streams that hold blocks may take total_bytes // OVERDRAFT_SHARE past
# the total (InflightBudget.overdraft_bytes): the budget bounds memory to 1/16 over.
OVERDRAFT_SHARE = 16
# The server's defaults (config.py: min_stream_rate, min_rate_window_s).
DEFAULT_RULE = ProgressRule(min_rate=64 * 1024, window_s=5.0)


_BACKGROUND: set[asyncio.Task[None]] = set()


def _spawn(work: Coroutine[None, None, None]) -> None:
    """Run ``work`` as a task, kept referenced until it ends."""
    task = asyncio.ensure_future(work)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


class InflightBudget:
    """Bytes reserved by all streams, per owner, against ``total`` and ``share``."""

    def __init__(
        self,
        total_bytes: int,
        share_bytes: int,
        idle_timeout_s: float,
        rule: ProgressRule = DEFAULT_RULE,
    ) -> None:
        if not 0 < share_bytes <= total_bytes:
            raise ValueError(
                f"share_bytes: must be in (0, total_bytes={total_bytes}], got {share_bytes}"
            )
        if not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s: must be > 0, got {idle_timeout_s}")
        self.total_bytes = total_bytes
        self.share_bytes = share_bytes
        self.idle_timeout_s = idle_timeout_s
        self.rule = rule
        self.used_bytes = 0
        self.peak_bytes = 0
        self._owners: dict[str, int] = {}
        self._waiters: deque[asyncio.Future[None]] = deque()
        # Leases waiting for their peer while they hold bytes (reclaim_idle).
        self._holders: set[Lease] = set()
        self.reclaimed = 0
        self.cut_slow = 0

    def owner_bytes(self, owner: str) -> int:
        """Bytes ``owner``'s streams hold reserved now."""
        return self._owners.get(owner, 0)

    def lease(self, owner: str) -> Lease:
        """A lease for one stream of ``owner``."""
        return Lease(self, owner)

    @property
    def overdraft_bytes(self) -> int:
        """How far past ``total_bytes`` read credits of streams holding blocks may go."""
        return self.total_bytes // OVERDRAFT_SHARE

    def _fits(self, owner: str, n: int, overdraft: bool = False) -> bool:
        held = self._owners.get(owner, 0)
        if held == 0 and self.used_bytes == 0:
            return True  # alone, any one reservation goes (it is at most one frame/window)
        if overdraft and self.used_bytes + n <= self.total_bytes + self.overdraft_bytes:
            return True
        return self.used_bytes + n <= self.total_bytes and held + n <= self.share_bytes

    async def _reserve(self, owner: str, n: int, what: str, overdraft: bool = False) -> None:
        """Take ``n`` bytes for ``owner``, waiting up to the idle timeout; raises Refusal.

        ``overdraft``: the read credit of a stream that holds blocks, which may go past
        the total and the share by ``overdraft_bytes`` (see ``Lease.paced``)."""
        if n <= 0:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.idle_timeout_s
        while not self._fits(owner, n, overdraft):
            left = deadline - loop.time()
            if left <= 0:
                raise over_limit(
                    "inflight_budget",
                    f"{what}: the server's in-flight budget stayed full for "
                    f"{self.idle_timeout_s:g} s (this client holds {self.owner_bytes(owner)} "
                    f"of its {self.share_bytes}-byte share, all clients {self.used_bytes} of "
                    f"max_inflight_bytes {self.total_bytes}); retry later",
                )
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(asyncio.shield(waiter), min(left, self.rule.window_s / 4))
            except TimeoutError:
                self.reclaim_idle()
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self._owners[owner] = self._owners.get(owner, 0) + n
        self.used_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def reclaim_idle(self) -> int:
        """Cut the streams that hold budget and whose peer moved nothing for a window
        (``rule.window_s``) while others wait for room; how many were cut.

        A block is reserved whole when it opens (so every opened block can finish), and
        this keeps that promise from being squatted by a silent peer: a gRPC stream is
        otherwise given a whole frame's time at the minimum rate (progress.py).
        """
        now = asyncio.get_running_loop().time()
        cut = sum(lease._progress.reclaim(now) for lease in list(self._holders))
        self.reclaimed += cut
        return cut

    def _release(self, owner: str, n: int) -> None:
        if n <= 0:
            return
        left = self._owners[owner] - n
        if left:
            self._owners[owner] = left
        else:
            del self._owners[owner]
        self.used_bytes -= n
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)


class Lease:
    """What one stream holds of the budget; ``close`` (or ``with``) gives it all back.

    It also watches the stream's waits for its peer (``begin_wait`` .. ``end_wait``:
    reading the next Put frame, a Get frame being taken): while it holds bytes, the
    progress rule (progress.py); while it holds none, one silence timer per lease
    (``stream_idle_timeout_s``), so a wait costs two clock reads instead of a task and a
    timeout per frame.
    """

    __slots__ = (
        "_budget",
        "_credit",
        "_cut_held",
        "_held",
        "_on_stall",
        "_owner",
        "_progress",
        "_since",
        "_timer",
        "stalled",
    )

    def __init__(self, budget: InflightBudget, owner: str) -> None:
        self._budget = budget
        self._owner = owner
        self._held = 0
        self._since: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._on_stall: Callable[[], None] | None = None
        self._credit = 0  # of _held: room taken before a read, not yet given to a block
        self._progress = ProgressWatch(budget.rule, self._holding, self._fell_behind)
        self._cut_held = 0  # what it held when it was cut (its refusal says)
        self.stalled = False

    @property
    def held_bytes(self) -> int:
        """Bytes this stream holds reserved."""
        return self._held

    @property
    def cut_reason(self) -> CutReason | None:
        """Why the progress rule cut this stream (None: it did not)."""
        return self._progress.cut

    @property
    def reclaimed(self) -> bool:
        """Whether the stream was cut for its room (silent while others waited)."""
        return self._progress.cut is CutReason.RECLAIMED

    async def reserve(self, n: int, what: str, *, overdraft: bool = False) -> None:
        """Reserve ``n`` more bytes (waiting for room); raises Refusal."""
        await self._budget._reserve(self._owner, n, what, overdraft)
        self._held += n

    async def reserve_block(self, n: int, what: str) -> None:
        """Reserve a block of ``n`` bytes whose first frame was read on a read credit
        (``paced``): the credit becomes part of the block, the rest is reserved."""
        taken = min(self._credit, n)
        self._credit -= taken
        await self.reserve(n - taken, what)

    def release(self, n: int | None = None) -> None:
        """Give back ``n`` bytes (all of them by default)."""
        n = self._held if n is None else min(n, self._held)
        self._budget._release(self._owner, n)
        self._held -= n

    def close(self) -> None:
        """The stream is over: release everything, stop watching."""
        self.release()
        self._credit = 0
        self._since = None
        self._budget._holders.discard(self)
        self._progress.close()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def on_done(self, _call: object) -> None:
        """``close``, as a gRPC done callback of the call."""
        self.close()

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- progress and silence ------------------------------------------------------------
    def watch(self, on_stall: Callable[[], None]) -> None:
        """Call ``on_stall`` (once) when the stream is cut: too slow, or silent too long."""
        self._on_stall = on_stall

    def close_on_stall(self, frames: AsyncGenerator[bytes, None]) -> None:
        """On a stall, close ``frames`` (dropping the blocks it holds) and this lease."""

        async def close() -> None:
            if getattr(frames, "ag_running", False):  # resumed meanwhile: its owner closes it
                return
            await frames.aclose()
            self.close()

        self.watch(lambda: _spawn(close()))

    def begin_wait(self, expect: int | None = None) -> None:
        """A wait for the peer starts (a frame to read, bytes to be taken): each byte the
        peer moves is reported (``progress``), or, with ``expect``, the peer's bytes are
        seen only as one whole message of up to ``expect`` bytes (a gRPC frame)."""
        loop = asyncio.get_running_loop()
        self._since = loop.time()
        if self._held:
            self._budget._holders.add(self)
        self._progress.begin_wait(expect)
        if self._timer is None:
            self._timer = loop.call_at(self._since + self._budget.idle_timeout_s, self._check)

    def progress(self, n: int) -> None:
        """The peer moved ``n`` bytes during the current wait (which goes on)."""
        if n > 0:
            self._since = asyncio.get_running_loop().time()
            self._progress.progress(n)

    def end_wait(self, n: int = 0) -> None:
        """The wait is over; the peer moved ``n`` bytes in it."""
        self._since = None
        self._budget._holders.discard(self)
        self._progress.end_wait(n)

    def finished(self) -> None:
        """The peer has sent everything: its pace is no longer judged (the server's own
        work on what it holds follows)."""
        self._since = None
        self._budget._holders.discard(self)
        self._progress.close()

    def begin_block(self, size: int) -> None:
        """A block of ``size`` bytes opens: it is cut unless complete within its size
        at the minimum rate (plus the window)."""
        self._progress.begin_block(size)

    def end_block(self) -> None:
        """The open block is complete."""
        self._progress.end_block()

    def _holding(self) -> bool:
        return self._held > 0

    def _fell_behind(self, reason: CutReason) -> None:
        if reason is not CutReason.RECLAIMED:
            self._budget.cut_slow += 1
        self._stall()

    def _check(self) -> None:
        """The silence timer: only a wait that holds nothing is cut by it."""
        self._timer = None
        since = self._since
        if since is None or self.stalled:
            return  # not waiting now: the next begin_wait arms the timer again
        loop = asyncio.get_running_loop()
        if not self._held and loop.time() - since >= self._budget.idle_timeout_s:
            self._stall()
            return
        self._timer = loop.call_at(
            max(since, loop.time()) + self._budget.idle_timeout_s, self._check
        )

    def _stall(self) -> None:
        if self.stalled:
            return
        self.stalled = True
        self._cut_held = self._held
        if self._on_stall is not None:
            self._on_stall()

    def idle_cut(self, what: str = "PutFrame") -> Refusal:
        """The refusal of a Put stream cut for its pace: below the minimum rate, a frame
        or block over its bound, silent while others needed its room, or silent for
        ``stream_idle_timeout_s``."""
        reason = self._progress.cut
        if reason is None:
            return Refusal(
                RefusalKind.TOO_SLOW,
                "stream_idle",
                f"{what}: no frame for {self._budget.idle_timeout_s:g} s "
                "(stream_idle_timeout_s): the stream is cut and nothing of it is stored",
            )
        return self._slow_refusal(what, reason, "sent", " and nothing of it is stored")

    def slow_reader_cut(self, what: str) -> Refusal:
        """The refusal of a Get whose reader fell behind (or took nothing for the idle
        timeout)."""
        reason = self._progress.cut
        if reason is None:
            return Refusal(
                RefusalKind.TOO_SLOW,
                "stream_slow_reader",
                f"{what}: the client took no frame for {self._budget.idle_timeout_s:g} s "
                "(stream_idle_timeout_s): the stream is cut",
            )
        return self._slow_refusal(what, reason, "took", "")

    def _slow_refusal(self, what: str, reason: CutReason, verb: str, tail: str) -> Refusal:
        rule = self._budget.rule
        rate, window = rule.rate_text, f"{rule.window_s:g} s"
        if reason is CutReason.RECLAIMED:
            return Refusal(
                RefusalKind.TOO_SLOW,
                "stream_reclaimed",
                f"{what}: the stream held {self._cut_held} bytes of the in-flight budget and "
                f"the client {verb} nothing for {window} (min_rate_window_s) while other "
                f"streams waited for room: the stream is cut{tail}",
            )
        why = {
            CutReason.BELOW_RATE: f"the client {verb} fewer than {rate} (min_stream_rate) "
            f"over {window} of waiting (min_rate_window_s)",
            CutReason.WAIT_BOUND: (
                f"the client {verb} nothing for longer than its frame takes at {rate} "
                f"(min_stream_rate) plus {window} (min_rate_window_s)"
                if self._progress.cut_in_frame
                else f"the client {verb} nothing for {window} (min_rate_window_s), below "
                f"{rate} (min_stream_rate)"
            ),
            CutReason.BLOCK_BOUND: f"a block was not complete within its size at {rate} "
            f"(min_stream_rate) plus {window} (min_rate_window_s)",
        }[reason]
        return Refusal(
            RefusalKind.TOO_SLOW,
            "stream_too_slow",
            f"{what}: {why}, holding {self._cut_held} bytes of the in-flight budget: the "
            f"stream is cut{tail}",
        )

    async def paced(
        self,
        frames: AsyncIterator[bytes],
        credit: Callable[[], int],
        what: str,
        expect: Callable[[], int] | None = None,
    ) -> AsyncIterator[bytes]:
        """``frames``, each reserved in this lease before it is read and kept reserved
        until the lease closes; a stream that falls behind the progress rule (each frame
        a whole message of up to ``expect()`` bytes, by default its credit), or that holds
        nothing and sends nothing for the idle timeout, is cut (a TOO_SLOW Refusal).

        Before each read the lease takes ``credit()`` bytes (the largest frame the
        transport delivers when no reserved block covers the next frame, else 0; waiting
        for room, which raises an OVER_LIMIT Refusal when none comes): a read lets the
        sender's next message into the process, so its bytes must be counted before it
        starts, not once it is decoded. The receiver turns the credit into the block the
        frame opens (``reserve_block``); what it did not take is given back once the
        receiver is done with the frame. While a stream waits for room it reads nothing,
        and gRPC's flow control holds its sender to the transport's window.

        The watch cancels the waiting read (gRPC ends a cancelled read at once), and the
        cancel is turned into the refusal here.
        """
        task = asyncio.current_task()
        assert task is not None

        reading = False

        def cancel() -> None:  # a cut found outside the read is raised after it
            if reading:
                task.cancel()

        self.watch(cancel)
        iterator = aiter(frames)
        while True:
            if self.stalled:
                raise self.idle_cut()
            wanted = credit()
            # A stream holding whole blocks reads on an overdraft: its next read may be its
            # end, which frees them, and must not wait behind streams waiting for the room
            # it holds (a new block's first frame then waits in reserve_block, counted).
            await self.reserve(wanted, what, overdraft=self._held > 0)
            self._credit = wanted
            self.begin_wait(expect() if expect is not None else wanted)
            reading = True
            try:
                raw = await anext(iterator)
            except StopAsyncIteration:
                reading = False
                self.finished()
                return
            except asyncio.CancelledError:
                reading = False
                self.end_wait()
                if not self.stalled:
                    raise
                task.uncancel()
                raise self.idle_cut() from None
            reading = False
            self.end_wait(len(raw))
            if self.stalled:  # fell behind with this frame: cut before it is used
                raise self.idle_cut()
            yield raw
            # Whatever of the credit the receiver did not turn into a block.
            self.release(self._credit)
            self._credit = 0
