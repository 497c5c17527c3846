"""A plain-torch forward of the served model, outside vLLM's engine loop.

The correctness gate (``gate.py``) and the production blend check (``quality.py``) run
prompts through the worker's own model (vLLM's modules, vLLM's weights, reached through
``compat``) without vLLM's scheduler, paged cache or attention backend: the layer loop
of ``recompute/selective.py`` over a :class:`VllmStack`, with each layer's K/V in plain
buffers (:class:`BufferKV`) instead of vLLM's pages. A full prefill is the loop with
every position a miss; a blend is the loop over a reuse layout whose reused rows were
written into the buffers first; a continuation is the loop with the prompt as the exact
prefix. Nothing here touches vLLM's KV cache or forward context, so it can run while
the engine is idle, on any thread.
"""

from __future__ import annotations

import torch
from torch import nn

from nopecache.integrations.vllm import compat
from nopecache.integrations.vllm.blend_loop import VllmStack
from nopecache.recompute.policies import RecomputePolicy, ReuseLayout, none
from nopecache.recompute.selective import Stack, run_selective

__all__ = ["BufferKV", "PlainForward"]


class BufferKV:
    """Each layer's K/V of positions ``[0, length)`` in buffers of ``capacity`` rows.

    ``k``/``v``: ``[layers, capacity, kv_heads, head_dim]``; the loop writes fresh rows
    into :meth:`layer`'s views, so a prompt's buffers grow by continuation in place.
    """

    def __init__(self, stack: Stack, capacity: int) -> None:
        """Zeroed buffers for ``capacity`` positions of ``stack``'s model."""
        shape = (stack.num_layers, capacity, stack.num_kv_heads, stack.head_dim)
        self.k = torch.zeros(shape, dtype=stack.dtype, device=stack.device)
        self.v = torch.zeros(shape, dtype=stack.dtype, device=stack.device)
        self.length = 0

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the layer's rows ``[0, length)``."""
        return self.k[index, : self.length], self.v[index, : self.length]

    def cached(self, index: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the rows before the loop overwrites them."""
        return self.k[index, rows].clone(), self.v[index, rows].clone()

    def commit(self, index: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Fresh rows are in the views already."""


class PlainForward:
    """Prefills, greedy answers and teacher-forced logits of the served model."""

    def __init__(self, model: nn.Module, stack: Stack | None = None) -> None:
        """``model``: the served ``*ForCausalLM``; ``stack``: the loop's view of it (a
        :class:`VllmStack` of ``model`` unless given, e.g. one that records its K)."""
        self.model = model
        self.stack: Stack = VllmStack(model) if stack is None else stack
        self._none = none()

    def buffers(self, capacity: int) -> BufferKV:
        """Empty K/V buffers for ``capacity`` positions."""
        return BufferKV(self.stack, capacity)

    def prefill(
        self,
        tokens: list[int],
        kv: BufferKV,
        layout: ReuseLayout | None = None,
        policy: RecomputePolicy | None = None,
        *,
        output: bool = True,
    ) -> torch.Tensor | None:
        """Run ``tokens`` over ``layout`` (default: a full prefill) into ``kv``; the
        log-probabilities ``[vocab]`` of the token after them (None without ``output``).

        The rows ``layout`` reuses must be in ``kv`` already; the others are computed."""
        n = len(tokens)
        if layout is None:
            layout = ReuseLayout(n)
        kv.length = n
        ids = torch.tensor(tokens, dtype=torch.int64)
        run = run_selective(
            self.stack, kv, ids, layout, policy or self._none, output=output, lookahead=None
        )
        if not output:
            return None
        last = (run.positions == n - 1).nonzero().flatten()
        if last.numel() != 1:
            raise RuntimeError(f"the loop did not run the prompt's last position {n - 1}")
        hidden, residual = run.stream
        i = int(last[0])
        row = compat.final_logits(
            self.model, hidden[i : i + 1], None if residual is None else residual[i : i + 1]
        )
        return row[0].float().log_softmax(-1)

    def continue_with(self, tokens: list[int], kv: BufferKV, new: list[int]) -> torch.Tensor:
        """Log-probabilities ``[len(new), vocab]`` after each of ``new``, appended to
        ``tokens`` (whose K/V are in ``kv``); their K/V join ``kv``."""
        start = len(tokens)
        total = start + len(new)
        kv.length = total
        ids = torch.tensor(tokens + new, dtype=torch.int64)
        run = run_selective(self.stack, kv, ids, ReuseLayout(total, start), self._none, output=True)
        hidden, residual = run.stream
        return compat.final_logits(self.model, hidden, residual).float().log_softmax(-1)

    def greedy(
        self, tokens: list[int], kv: BufferKV, first: torch.Tensor, count: int
    ) -> tuple[list[int], torch.Tensor]:
        """``count`` greedy tokens after ``tokens`` (``first``: the log-probabilities after
        the prompt) and the log-probabilities ``[count, vocab]`` each was chosen from."""
        rows = [first]
        answer = [int(first.argmax())]
        while len(answer) < count:
            row = self.continue_with(tokens + answer[:-1], kv, answer[-1:])[0]
            rows.append(row)
            answer.append(int(row.argmax()))
        return answer, torch.stack(rows)

    def teacher_forced(
        self, tokens: list[int], kv: BufferKV, first: torch.Tensor, answer: list[int]
    ) -> torch.Tensor:
        """Log-probabilities ``[len(answer), vocab]`` along ``answer`` after ``tokens``
        (``first``: those after the prompt; the rest in one continuation)."""
        if len(answer) < 2:
            return first[None]
        return torch.cat([first[None], self.continue_with(tokens, kv, answer[:-1])])
