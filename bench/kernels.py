"""Throughput of the RoPE kernels against a plain copy of the same bytes, same run.

Shapes are Llama-3-8B's KV cache: 32 layers x 8 KV heads x head_dim 128, bf16, RoPE with
llama3 scaling, at 1k, 4k and 16k tokens. Runs on CUDA (Triton kernels) when present,
else on the CPU (the torch path ``nopecache.kernels.api`` takes for CPU tensors).

Bytes model (what each operation must move at the least, E = 2 bytes per bf16 element,
N = layers * tokens * heads * head_dim elements of K, the same of V):

    rotate            every layer's K read once and written once:           2 * N * E
    rerope_scatter    K and V read once, written once into the paged cache: 4 * N * E
    copy (baseline)   ``copy_`` of the same K and V into the same cache rows: 4 * N * E

Positions, slot mapping and cos/sin tables are O(tokens) and left out. GB/s = bytes /
best time of the repetitions: each repetition times copy, rotate and scatter back to back,
and the least-disturbed run of each is kept (on a shared machine a median measures the
neighbours). On a CPU shared with other work, ``OMP_NUM_THREADS=1`` gives steadier
figures: torch's worker threads wait for each other at every op, and a descheduled one
stalls all of them.

The scatter writes into per-layer caches ``[num_blocks, 16, 8, 128]`` through a slot
mapping of whole 16-slot blocks in shuffled order, as an engine's block allocator hands
them out; the copy baseline writes the same bytes into the first slots of those caches.

RESULT: ``*_gbps`` at 16k tokens (steady state); ``scatter_vs_copy`` is the lowest ratio
copy_time / scatter_time over the three sizes (1.0 = as fast as a copy).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nopecache.kernels import RopeSpec, rerope_scatter_layers
from nopecache.kernels.api import rotate

LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
TOKENS = (1024, 4096, 16384)
LLAMA3_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": HEADS,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}


@dataclass(frozen=True, slots=True)
class Row:
    """Best seconds of each operation at one token count."""

    tokens: int
    copy_s: float
    rotate_s: float
    scatter_s: float

    def gbps(self, seconds: float, factor: int) -> float:
        """GB/s for an operation moving ``factor * N * E`` bytes in ``seconds``."""
        return factor * LAYERS * self.tokens * HEADS * HEAD_DIM * 2 / seconds / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], None], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def measure(tokens: int, spec: RopeSpec, device: torch.device, reps: int, warm_up: bool) -> Row:
    """Time copy, rotate and rerope_scatter_layers at ``tokens`` tokens."""
    gen = torch.Generator().manual_seed(tokens)
    shape = (LAYERS, tokens, HEADS, HEAD_DIM)
    k = torch.randn(shape, generator=gen).to(device=device, dtype=torch.bfloat16)
    v = torch.randn(shape, generator=gen).to(device=device, dtype=torch.bfloat16)
    positions = torch.randint(0, 100_000, (tokens,), generator=gen).to(device)
    blocks = tokens // BLOCK_SIZE
    order = torch.randperm(blocks, generator=gen)
    slots = (order[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten().to(device)
    cache_shape = (blocks, BLOCK_SIZE, HEADS, HEAD_DIM)
    k_caches = [
        torch.empty(cache_shape, dtype=torch.bfloat16, device=device) for _ in range(LAYERS)
    ]
    v_caches = [
        torch.empty(cache_shape, dtype=torch.bfloat16, device=device) for _ in range(LAYERS)
    ]
    rotated = torch.empty((tokens, HEADS, HEAD_DIM), dtype=torch.bfloat16, device=device)

    def copy() -> None:
        for layer in range(LAYERS):
            k_caches[layer].view(-1, HEADS, HEAD_DIM).copy_(k[layer])
            v_caches[layer].view(-1, HEADS, HEAD_DIM).copy_(v[layer])

    def rotate_all() -> None:
        for layer in range(LAYERS):
            rotate(k[layer], None, positions, spec, out=rotated)

    def scatter() -> None:
        rerope_scatter_layers(k, v, positions, slots, k_caches, v_caches, spec)

    times: dict[str, list[float]] = {"copy": [], "rotate": [], "scatter": []}
    ops = {"copy": copy, "rotate": rotate_all, "scatter": scatter}
    if warm_up:  # allocator, Triton compilation, first-touch page faults
        for fn in ops.values():
            _timed(fn, device)
    for _ in range(reps):
        for name, fn in ops.items():
            times[name].append(_timed(fn, device))
    return Row(tokens, min(times["copy"]), min(times["rotate"]), min(times["scatter"]))


def main() -> None:
    """Print one line per token count, then the RESULT line."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    spec = RopeSpec.from_hf_config(LLAMA3_8B)
    threads = torch.get_num_threads()
    print(f"device={label} threads={threads} layers={LAYERS} heads={HEADS} head_dim={HEAD_DIM}")
    rows = []
    for tokens in TOKENS:
        # Fewer repetitions where one already moves gigabytes (keeps the CPU run short).
        reps = 10 if device.type == "cuda" else {1024: 5, 4096: 3, 16384: 2}[tokens]
        row = measure(tokens, spec, device, reps, warm_up=tokens == TOKENS[0])
        rows.append(row)
        print(
            f"tokens={tokens:6d} copy {row.gbps(row.copy_s, 4):7.2f} GB/s  "
            f"rotate {row.gbps(row.rotate_s, 2):7.2f} GB/s  "
            f"scatter {row.gbps(row.scatter_s, 4):7.2f} GB/s  "
            f"scatter/copy time {row.scatter_s / row.copy_s:5.2f}x",
            flush=True,
        )
    last = rows[-1]
    worst = min(r.copy_s / r.scatter_s for r in rows)
    print(
        f"RESULT device={device.type} rotate_gbps={last.gbps(last.rotate_s, 2):.2f} "
        f"scatter_gbps={last.gbps(last.scatter_s, 4):.2f} copy_gbps={last.gbps(last.copy_s, 4):.2f} "
        f"scatter_vs_copy={worst:.3f}"
    )


if __name__ == "__main__":
    main()
