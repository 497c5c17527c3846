"""Stop child processes and everything below them within a bound: one process group each.

A child that leads a process group of its own (``Popen(process_group=0)``, or
``os.setpgid(0, 0)`` as its first step) takes its own children into that group: vLLM's
engine-core process below an engine, anything a library forks. Stopping the group
reaches all of them, where signalling the child alone would orphan them::

    SIGTERM to every group       each child unwinds (its cleanup runs)
    wait until the groups are    an event (the last member gone), polled every 50 ms;
      empty, at most grace_s     the grace only bounds a child stuck in a long C call
    SIGKILL to what is left      cannot be ignored: the stop ends here
    reap the direct children

So a stop takes at most ``grace_s`` plus the kernel's SIGKILL, whatever the children were
doing. Imports nothing heavy: the demos' parent processes use it in either environment.

A demo's own Ctrl-C (:func:`interrupt_on_signals`): the first SIGINT or SIGTERM raises
KeyboardInterrupt and later ones are ignored, so no second Ctrl-C cuts a stop halfway and
leaves a child running. Inside :func:`stopping` even the first is held back until the
stop is done: a signal that comes while the demo shuts down normally ends it all the same.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import FrameType

__all__ = ["STOP_GRACE_S", "Group", "interrupt_on_signals", "stop_groups", "stopping"]

STOP_GRACE_S = 10.0
"""How long children get to unwind after SIGTERM before SIGKILL. A model's forward
checks for the signal between torch ops and a cache client closes in well under a
second on an idle machine; 10 s leaves room for a machine loaded several times over."""

_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class Group:
    """A direct child that leads its own process group, and how to reap it.

    ``reap(timeout)`` waits up to ``timeout`` seconds (None: until it exits) for the
    child and collects its exit status, so that its zombie leaves the group; it returns
    whether the child has exited (``Popen.wait`` or ``Process.join`` wrapped).
    """

    pid: int
    reap: Callable[[float | None], bool]


def _signal(pid: int, sig: int) -> bool:
    """Send ``sig`` to the group ``pid`` leads; whether any process received it.

    A child that was to make its group itself (``os.setpgid(0, 0)``) may not have done
    so yet: then the signal goes to the child alone.
    """
    try:
        os.killpg(pid, sig)
        return True
    except ProcessLookupError:
        pass
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def _alive(group: Group) -> bool:
    """Whether a process of the group still runs. Zombies do not count: they have
    exited, but ``kill(-pgid, 0)`` still reaches them until their parent reaps them, and
    an orphan's parent is PID 1, which in a container need not reap at once (here it
    took 1.7 s; a CI run's stop waited out the whole grace once per group on such
    zombies and overran its bound)."""
    group.reap(0)  # our own zombie leader: reap it, its status is ours to collect
    if not _signal(group.pid, 0):
        return False
    return _live_member(group.pid)


def _live_member(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is not a zombie (read from /proc; where it
    cannot be read, every member counts)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()  # state, ppid, pgrp, ...
        except OSError:  # exited meanwhile
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


def stop_groups(groups: Sequence[Group], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every group, wait until all are empty (at most ``grace_s``), SIGKILL the
    rest, reap the children. Every group is signalled before any is waited for."""
    for group in groups:
        _signal(group.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    left = [g for g in groups if _alive(g)]
    while left and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        left = [g for g in left if _alive(g)]
    for group in left:
        _signal(group.pid, signal.SIGKILL)
    for group in groups:
        with contextlib.suppress(ChildProcessError):
            group.reap(None)  # after SIGKILL: no wait beyond the kernel's


_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_stopping = 0  # how many stopping() blocks are open (the main thread's: signals go there)
_held = False  # a signal came inside one


def interrupt_on_signals() -> None:
    """SIGINT (a terminal's Ctrl-C) and SIGTERM (a service manager) raise KeyboardInterrupt
    in the main thread, once; see the module's docstring."""
    for sig in _SIGNALS:
        signal.signal(sig, _interrupt)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    global _held
    if _stopping:
        _held = True
        return
    _raise()


def _raise() -> None:
    for sig in _SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


@contextlib.contextmanager
def stopping() -> Iterator[None]:
    """Hold an interrupt back while the block stops children; raise it after."""
    global _stopping, _held
    _stopping += 1
    try:
        yield
    finally:
        _stopping -= 1
        if not _stopping and _held:
            _held = False
            _raise()
