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

Deadlines (``stream_idle_timeout_s``): a Put stream that sends no frame for that long, a
reservation that cannot be had for that long, and a Get frame the reader does not take
for that long end the call with a :class:`~.refusal.Refusal` (TOO_SLOW for an idle or
slow peer, OVER_LIMIT for a full budget; each codec words it for its wire), and nothing
of a cut Put is stored.

Concurrency: one event loop; reservations change only between awaits. Waiters are woken
on every release and re-check, oldest first.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine

from nopecache.cache_server.refusal import Refusal, RefusalKind, over_limit

__all__ = ["RECLAIM_AFTER_S", "InflightBudget", "Lease"]

# Read credits of streams that hold blocks may take total_bytes // OVERDRAFT_SHARE past
# the total (InflightBudget.overdraft_bytes): the budget bounds memory to 1/16 over.
OVERDRAFT_SHARE = 16
# A stream holding budget that has waited this long for its sender, while other streams
# wait for room, is cut (InflightBudget.reclaim_idle).
RECLAIM_AFTER_S = 1.0


_BACKGROUND: set[asyncio.Task[None]] = set()


def _spawn(work: Coroutine[None, None, None]) -> None:
    """Run ``work`` as a task, kept referenced until it ends."""
    task = asyncio.ensure_future(work)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


class InflightBudget:
    """Bytes reserved by all streams, per owner, against ``total`` and ``share``."""

    def __init__(self, total_bytes: int, share_bytes: int, idle_timeout_s: float) -> None:
        if not 0 < share_bytes <= total_bytes:
            raise ValueError(
                f"share_bytes: must be in (0, total_bytes={total_bytes}], got {share_bytes}"
            )
        if not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s: must be > 0, got {idle_timeout_s}")
        self.total_bytes = total_bytes
        self.share_bytes = share_bytes
        self.idle_timeout_s = idle_timeout_s
        self.used_bytes = 0
        self.peak_bytes = 0
        self._owners: dict[str, int] = {}
        self._waiters: deque[asyncio.Future[None]] = deque()
        # Leases holding bytes while they wait for their peer to send (reclaim_idle).
        self._holders: set[Lease] = set()
        self.reclaimed = 0

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
                await asyncio.wait_for(asyncio.shield(waiter), min(left, RECLAIM_AFTER_S))
            except TimeoutError:
                self.reclaim_idle()
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self._owners[owner] = self._owners.get(owner, 0) + n
        self.used_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def reclaim_idle(self) -> int:
        """Cut the streams that hold budget and have waited for their sender for
        ``RECLAIM_AFTER_S`` while others wait for room; how many were cut.

        A block is reserved whole when it opens (so every opened block can finish), and
        this is what keeps that promise from being squatted: a stream that announced a
        big block and sends nothing more keeps its room only while nobody needs it.
        """
        now = asyncio.get_running_loop().time()
        cut = 0
        for lease in list(self._holders):
            since = lease._since
            if since is not None and not lease.stalled and now - since >= RECLAIM_AFTER_S:
                lease.reclaimed = True
                lease._stall()
                cut += 1
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

    It also watches the stream's waits: between ``begin_wait`` and ``end_wait`` (reading
    the next Put frame, writing a Get frame) one timer per lease checks the idle timeout,
    so a wait costs two clock reads instead of a task and a timeout per frame.
    """

    __slots__ = (
        "_budget",
        "_credit",
        "_held",
        "_on_stall",
        "_owner",
        "_since",
        "_timer",
        "reclaimed",
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
        self.stalled = False
        self.reclaimed = False

    @property
    def held_bytes(self) -> int:
        """Bytes this stream holds reserved."""
        return self._held

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

    # -- idle watch ----------------------------------------------------------------------
    def watch(self, on_stall: Callable[[], None]) -> None:
        """Call ``on_stall`` (once) when a wait lasts the idle timeout."""
        self._on_stall = on_stall

    def close_on_stall(self, frames: AsyncGenerator[bytes, None]) -> None:
        """On a stall, close ``frames`` (dropping the blocks it holds) and this lease."""

        async def close() -> None:
            if getattr(frames, "ag_running", False):  # resumed meanwhile: its owner closes it
                return
            await frames.aclose()
            self.close()

        self.watch(lambda: _spawn(close()))

    def begin_wait(self, *, reclaimable: bool = False) -> None:
        """A wait for the peer starts (a frame to read, a frame to be taken); with
        ``reclaimable``, a wait for a sender that the budget may cut when others need the
        room this stream holds (InflightBudget.reclaim_idle)."""
        loop = asyncio.get_running_loop()
        self._since = loop.time()
        if reclaimable and self._held:
            self._budget._holders.add(self)
        if self._timer is None:
            self._timer = loop.call_at(self._since + self._budget.idle_timeout_s, self._check)

    def end_wait(self) -> None:
        """The wait is over."""
        self._since = None
        self._budget._holders.discard(self)

    def _check(self) -> None:
        self._timer = None
        since = self._since
        if since is None or self.stalled:
            return  # not waiting now: the next begin_wait arms the timer again
        loop = asyncio.get_running_loop()
        if loop.time() - since >= self._budget.idle_timeout_s:
            self._stall()
            return
        self._timer = loop.call_at(since + self._budget.idle_timeout_s, self._check)

    def _stall(self) -> None:
        self.stalled = True
        if self._on_stall is not None:
            self._on_stall()

    def idle_cut(self) -> Refusal:
        """The refusal of a Put stream that sent nothing for the idle timeout (or held
        budget others waited for and sent nothing for RECLAIM_AFTER_S)."""
        if self.reclaimed:
            return Refusal(
                RefusalKind.TOO_SLOW,
                "stream_reclaimed",
                f"PutFrame: the stream held {self._held} bytes of the in-flight budget and "
                f"sent nothing for {RECLAIM_AFTER_S:g} s while other streams waited for "
                "room: the stream is cut and nothing of it is stored",
            )
        return Refusal(
            RefusalKind.TOO_SLOW,
            "stream_idle",
            f"PutFrame: no frame for {self._budget.idle_timeout_s:g} s "
            "(stream_idle_timeout_s): the stream is cut and nothing of it is stored",
        )

    def slow_reader_cut(self, what: str) -> Refusal:
        """The refusal of a Get whose reader took no frame for the idle timeout."""
        return Refusal(
            RefusalKind.TOO_SLOW,
            "stream_slow_reader",
            f"{what}: the client took no frame for {self._budget.idle_timeout_s:g} s "
            "(stream_idle_timeout_s): the stream is cut",
        )

    async def paced(
        self, frames: AsyncIterator[bytes], credit: Callable[[], int], what: str
    ) -> AsyncIterator[bytes]:
        """``frames``, each reserved in this lease before it is read and kept reserved
        until the lease closes; a frame that does not come within the idle timeout cuts
        the stream (a TOO_SLOW Refusal).

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

        def cancel() -> None:
            task.cancel()

        self.watch(cancel)
        iterator = aiter(frames)
        while True:
            wanted = credit()
            # A stream holding whole blocks reads on an overdraft: its next read may be its
            # end, which frees them, and must not wait behind streams waiting for the room
            # it holds (a new block's first frame then waits in reserve_block, counted).
            await self.reserve(wanted, what, overdraft=self._held > 0)
            self._credit = wanted
            # No credit: the frame belongs to an open block, whose room may be reclaimed.
            self.begin_wait(reclaimable=not wanted)
            try:
                raw = await anext(iterator)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if not self.stalled:
                    raise
                task.uncancel()
                raise self.idle_cut() from None
            finally:
                self.end_wait()
            yield raw
            # Whatever of the credit the receiver did not turn into a block.
            self.release(self._credit)
            self._credit = 0
