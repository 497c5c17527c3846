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
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["STOP_GRACE_S", "Group", "stop_groups"]

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
    group.reap(0)  # a zombie leader still counts as a member of its group
    return _signal(group.pid, 0)


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
