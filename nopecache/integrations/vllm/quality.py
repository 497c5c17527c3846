"""Blend quality watched in production: sampled blended requests re-checked in the background.

The correctness gate (``gate.py``) measures blend on three built-in prompts at start-up;
real traffic reuses other chunks at other offsets. So a share of the blended requests
(``blend_check_share``, default 0.01: one in a hundred; 0: none) is re-checked:

    worker thread (in the step)          checker thread (while the worker is idle)
    -------------------------            ------------------------------------------
    _blend_one: the loop ran over        full prefill of the whole prompt, plain torch
      [0, end) of a sampled request      (plain.py): greedy answer, CHECK_ANSWER_TOKENS
    copy K/V [0, end) out of the pages   blend: the copied K/V [0, end) as vLLM held them,
      (what vLLM's forward attends to)     the prompt's rest computed over them
    hand the copy to the checker         KL(full || blend) and top-1 along the answer,
                                           teacher-forced (recompute/gate.py)
                                         -> vllm:nopecache_blend_kl, _blend_top1

Sampling is deterministic (every ``1 / share``-th blended request; :class:`ShareSampler`),
and one check is pending at a time: a sample offered while one waits is skipped, so
memory stays at one copy of one prompt's K/V.

The checker runs the served model's own modules, and those are not safe to enter from two
threads at once: vLLM's CPU linear layers go through per-layer oneDNN handlers that cache
primitives and scratch space unguarded (a check that overlapped the engine's steps measured
KL nan in CI). So the engine and the checker take turns (:class:`EngineTurns`): the engine's
turn is a step (from its loads to its saves) and every ``compute_logits`` call (vLLM's
sampler runs the LM head after the connector's step hooks); the checker's turn is one
segment, a layer of one prompt, taken only when the engine had no turn for ``idle_s``.
An engine turn that begins during a segment waits for that segment to end: a check delays
a step by at most one layer of one prompt, and on a saturated engine it waits (checks are
a spare-capacity job, never the traffic's cost).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nopecache.client.errors import InvalidArgumentError
from nopecache.integrations.vllm.blend_loop import VllmStack
from nopecache.integrations.vllm.plain import PlainForward
from nopecache.recompute.gate import divergence
from nopecache.recompute.policies import ReuseLayout

__all__ = [
    "CHECK_ANSWER_TOKENS",
    "BlendCheck",
    "ChecksClosed",
    "EngineTurns",
    "QualityWatch",
    "ShareSampler",
]

log = logging.getLogger(f"vllm.{__name__}")

CHECK_ANSWER_TOKENS = 8
"""Greedy answer tokens of the full prefill compared per checked request."""


class ShareSampler:
    """Say yes to a ``share`` of calls, evenly: every ``1 / share``-th (share in [0, 1])."""

    def __init__(self, share: float) -> None:
        """A sampler of ``share``; InvalidArgumentError outside [0, 1]."""
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1:
            raise InvalidArgumentError("blend_check_share", f"must be in [0, 1], got {share!r}")
        self.share = float(share)
        self._credit = 0.0

    def take(self) -> bool:
        """Whether this call is sampled."""
        if self.share <= 0:
            return False
        self._credit += self.share
        if self._credit >= 1.0 - 1e-9:
            self._credit -= 1.0
            return True
        return False


@dataclass(frozen=True, slots=True)
class BlendCheck:
    """One checked request: mean KL(full || blend) and top-1 agreement over its answer."""

    req_id: str
    kl: float
    top1: float
    tokens: int  # answer tokens compared


@dataclass(frozen=True, slots=True)
class _Sample:
    req_id: str
    tokens: list[int]  # the whole prompt
    k: torch.Tensor  # [layers, end, kv_heads, head_dim] as vLLM's cache held them
    v: torch.Tensor


class ChecksClosed(Exception):
    """The watch closed while a check waited for its turn."""


class EngineTurns:
    """Turns on the served model between the engine's thread and one checker thread.

    Engine turns: :meth:`step_began` .. :meth:`step_ended`, and :meth:`engine_call`
    (nestable, from any thread but the checker's). Checker turns: segments, each begun by
    :meth:`next_segment` (which ends the previous one) and the last ended by
    :meth:`end_segments`. The two never overlap (module doc).
    """

    def __init__(self, idle_s: float) -> None:
        """Segments begin only after ``idle_s`` seconds without an engine turn."""
        self.idle_s = idle_s
        self._cond = threading.Condition()
        self._step = False
        self._calls = 0
        self._last = time.monotonic()
        self._segment = False
        self._closed = False

    def _engine_waits(self) -> None:
        while self._segment:
            self._cond.wait()

    def step_began(self) -> None:
        """An engine step begins; it waits for a segment in progress to end."""
        with self._cond:
            self._step = True
            self._engine_waits()

    def step_ended(self) -> None:
        """The step ended."""
        with self._cond:
            self._step = False
            self._last = time.monotonic()
            self._cond.notify_all()

    @contextmanager
    def engine_call(self) -> Iterator[None]:
        """An engine turn around one call (waits for a segment in progress to end)."""
        with self._cond:
            self._calls += 1
            self._engine_waits()
        try:
            yield
        finally:
            with self._cond:
                self._calls -= 1
                self._last = time.monotonic()
                self._cond.notify_all()

    def next_segment(self) -> None:
        """End the checker's segment (if any) and begin the next once the engine idles;
        :class:`ChecksClosed` when :meth:`close` was called."""
        with self._cond:
            self._segment = False
            self._cond.notify_all()
            while True:
                if self._closed:
                    raise ChecksClosed
                busy = self._step or self._calls > 0
                quiet = time.monotonic() - self._last
                if not busy and quiet >= self.idle_s:
                    self._segment = True
                    return
                self._cond.wait(None if busy else self.idle_s - quiet)

    def guard(self, obj: object, name: str, checker: threading.Thread) -> Callable[[], None]:
        """Make every call of ``obj.name`` an engine turn, except calls from ``checker``
        (inside its own segment); returns the undo."""
        own = name in vars(obj)
        original = getattr(obj, name)

        def guarded(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is checker:
                return original(*args, **kwargs)
            with self.engine_call():
                return original(*args, **kwargs)

        setattr(obj, name, guarded)

        def undo() -> None:
            if own:
                setattr(obj, name, original)
            else:
                delattr(obj, name)

        return undo

    def end_segments(self) -> None:
        """The checker's last segment ended."""
        with self._cond:
            self._segment = False
            self._cond.notify_all()

    def close(self) -> None:
        """Segments waiting for their turn raise :class:`ChecksClosed`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class _YieldingStack(VllmStack):
    """VllmStack whose every layer is a new checker segment."""

    def __init__(self, model: nn.Module, turns: EngineTurns) -> None:
        super().__init__(model)
        self._turns = turns

    def attention_input(self, layer: int, stream: Any) -> Any:
        self._turns.next_segment()
        return super().attention_input(layer, stream)


class QualityWatch:
    """Samples blended requests and checks them on a background thread (module doc)."""

    def __init__(self, model: nn.Module, share: float, *, idle_s: float = 0.05) -> None:
        """Check ``share`` of the blended requests of ``model`` (a served ``*ForCausalLM``)
        when no engine turn happened for ``idle_s`` seconds. Wraps ``model.compute_logits``
        (the engine's LM head runs outside its steps) until :meth:`close`."""
        self.sampler = ShareSampler(share)
        self.turns = EngineTurns(idle_s)
        self._forward = PlainForward(model, _YieldingStack(model, self.turns))
        self._cond = threading.Condition()
        self._pending: _Sample | None = None
        self._closed = False
        self._done: list[BlendCheck] = []
        self.skipped = 0  # samples dropped because one was pending
        self._thread = threading.Thread(target=self._run, name="nopecache-blend-check", daemon=True)
        self._unguard = self.turns.guard(model, "compute_logits", self._thread)
        self._thread.start()

    # -- the worker's side --------------------------------------------------------------
    def step_began(self) -> None:
        """An engine step starts: it waits for a check's layer in progress to end."""
        self.turns.step_began()

    def step_ended(self) -> None:
        """The step ended."""
        self.turns.step_ended()

    def offer(
        self,
        req_id: str,
        tokens: list[int],
        read_kv: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    ) -> bool:
        """A blended request: when sampled (and none pending), copy its K/V [0, end) now
        with ``read_kv`` and queue its check. True when queued."""
        if not self.sampler.take():
            return False
        with self._cond:
            if self._pending is not None or self._closed:
                self.skipped += 1
                return False
        k, v = read_kv()
        with self._cond:
            self._pending = _Sample(req_id, list(tokens), k, v)
            self._cond.notify_all()
        return True

    def take(self) -> list[BlendCheck]:
        """Checks finished since the last call."""
        with self._cond:
            done, self._done = self._done, []
        return done

    def close(self) -> None:
        """Stop the checker (a check in progress is abandoned) and unwrap the model."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.turns.close()
        self._thread.join(timeout=30)
        self._unguard()

    # -- the checker thread -------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                sample = self._pending
            assert sample is not None
            try:
                with torch.no_grad():
                    check = self._check(sample)
            except ChecksClosed:
                return
            except Exception:  # a check must never take the worker down
                log.exception("nopecache: blend check of %s failed", sample.req_id)
                check = None
            finally:
                self.turns.end_segments()
            if check is not None and not (math.isfinite(check.kl) and math.isfinite(check.top1)):
                # Not exported: one nan would poison the histograms' sums for good.
                log.error("nopecache: blend check of %s is not finite: %s", sample.req_id, check)
                check = None
            with self._cond:
                self._pending = None
                if check is not None:
                    self._done.append(check)
            if check is not None:
                log.info(
                    "nopecache: blend check of %s: KL %.4f, top-1 %.3f over %d answer tokens",
                    check.req_id,
                    check.kl,
                    check.top1,
                    check.tokens,
                )

    def _check(self, sample: _Sample) -> BlendCheck:
        self.turns.next_segment()  # the embeddings before the first layer's segment
        fwd, tokens = self._forward, sample.tokens
        end = sample.k.shape[1]
        kv = fwd.buffers(len(tokens) + CHECK_ANSWER_TOKENS)
        first = fwd.prefill(tokens, kv)
        assert first is not None
        answer, reference = fwd.greedy(tokens, kv, first, CHECK_ANSWER_TOKENS)
        blended = fwd.buffers(len(tokens) + CHECK_ANSWER_TOKENS)
        blended.k[:, :end], blended.v[:, :end] = sample.k, sample.v
        first_blend = fwd.prefill(tokens, blended, ReuseLayout(len(tokens), end))
        assert first_blend is not None
        rows = fwd.teacher_forced(tokens, blended, first_blend, answer)
        kl, agree = divergence(reference, rows)
        return BlendCheck(sample.req_id, float(kl.mean()), float(agree.float().mean()), len(answer))
