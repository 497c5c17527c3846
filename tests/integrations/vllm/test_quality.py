"""The production blend check's sampling and turn taking (quality.py), without a model."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from nopecache.client.errors import InvalidArgumentError
from nopecache.integrations.vllm.quality import ChecksClosed, EngineTurns, ShareSampler


@pytest.mark.parametrize(("share", "every"), [(1.0, 1), (0.5, 2), (0.25, 4), (0.01, 100)])
def test_the_sampler_takes_every_nth(share: float, every: int) -> None:
    sampler = ShareSampler(share)
    taken = [i for i in range(1, 4 * every + 1) if sampler.take()]
    assert taken == [every, 2 * every, 3 * every, 4 * every]


def test_share_zero_never_samples() -> None:
    sampler = ShareSampler(0)
    assert not any(sampler.take() for _ in range(10_000))


@pytest.mark.parametrize("share", [-0.01, 1.01, True, "0.1", float("nan")])
def test_the_sampler_refuses_a_share_outside_zero_one(share: object) -> None:
    with pytest.raises(InvalidArgumentError, match="blend_check_share"):
        ShareSampler(share)  # type: ignore[arg-type]


# -- EngineTurns: the engine and the checker never run the model at once -----------------


def _in_thread(target: Callable[[], object]) -> tuple[threading.Thread, threading.Event]:
    done = threading.Event()

    def run() -> None:
        target()
        done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, done


def test_a_step_that_begins_during_a_segment_waits_for_its_end() -> None:
    turns = EngineTurns(idle_s=0.0)
    turns.next_segment()  # the checker runs a layer
    _, began = _in_thread(turns.step_began)
    assert not began.wait(0.3)  # the step waits while the segment runs
    turns.end_segments()
    assert began.wait(10)
    turns.step_ended()


def test_an_engine_call_during_a_segment_waits_for_its_end() -> None:
    turns = EngineTurns(idle_s=0.0)
    calls: list[str] = []

    def call() -> None:
        with turns.engine_call():
            calls.append("engine")

    turns.next_segment()
    _, called = _in_thread(call)
    assert not called.wait(0.3)
    assert calls == []
    turns.next_segment()  # ends this segment; the waiting call goes first
    assert called.wait(10)
    assert calls == ["engine"]
    turns.end_segments()


def test_a_segment_waits_for_the_step_and_the_idle_time_after_it() -> None:
    turns = EngineTurns(idle_s=0.2)
    turns.step_began()
    _, began = _in_thread(turns.next_segment)
    assert not began.wait(0.3)  # never during a step
    ended = time.monotonic()
    turns.step_ended()
    assert began.wait(10)
    assert time.monotonic() - ended >= 0.2  # and only after idle_s without a turn
    turns.end_segments()


def test_a_segment_waits_for_an_engine_call_in_progress() -> None:
    turns = EngineTurns(idle_s=0.0)
    inside, leave = threading.Event(), threading.Event()

    def call() -> None:
        with turns.engine_call():
            inside.set()
            leave.wait(10)

    _in_thread(call)
    assert inside.wait(10)
    _, began = _in_thread(turns.next_segment)
    assert not began.wait(0.3)
    leave.set()
    assert began.wait(10)
    turns.end_segments()


def test_close_wakes_a_segment_waiting_for_its_turn() -> None:
    turns = EngineTurns(idle_s=0.0)
    turns.step_began()
    raised: list[type[BaseException]] = []

    def segment() -> None:
        try:
            turns.next_segment()
        except ChecksClosed as e:
            raised.append(type(e))

    _, done = _in_thread(segment)
    turns.close()
    assert done.wait(10)
    assert raised == [ChecksClosed]


class _Model:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def compute_logits(self, x: int) -> int:
        self.calls.append(threading.current_thread().name)
        return x + 1


def test_guarded_calls_are_engine_turns_except_the_checkers_own() -> None:
    turns = EngineTurns(idle_s=0.0)
    model = _Model()
    results: list[int] = []

    def check() -> None:
        turns.next_segment()
        results.append(model.compute_logits(1))

    checker = threading.Thread(target=check, name="checker")
    undo = turns.guard(model, "compute_logits", checker)
    checker.start()
    checker.join(10)
    assert results == [2]  # the checker's own call ran inside its segment: no deadlock
    _, called = _in_thread(lambda: results.append(model.compute_logits(2)))
    assert not called.wait(0.3)  # the engine's call waits for the segment to end
    turns.end_segments()
    assert called.wait(10)
    assert results == [2, 3]
    undo()
    assert "compute_logits" not in vars(model)  # the class's method again
    assert model.compute_logits(5) == 6
