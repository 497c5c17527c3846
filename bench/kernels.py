"""Throughput of the RoPE kernels against a plain copy of the same bytes, same run.

Shapes are Llama-3-8B's KV cache: 32 layers x 8 KV heads x head_dim 128, bf16, RoPE with
llama3 scaling, at 1k, 4k and 16k tokens, positions drawn from [0, 128k). Runs on CUDA
(Triton kernels) when present, else on the CPU (the torch path ``nopecache.kernels.api``
takes for CPU tensors).

Bytes model (what each operation must move at the least, E = 2 bytes per bf16 element,
N = layers * tokens * heads * head_dim elements of K, the same of V):

    rotate            every layer's K read once and written once:           2 * N * E
    rerope_scatter    K and V read once, written once into the paged cache: 4 * N * E
    copy (baseline)   one ``copy_`` of a 2 * N element buffer into another: 4 * N * E

The baseline is one large copy (bandwidth-bound, one launch), not a copy per layer:
that is the speed of light the scatter is held against. Positions, slot mapping and
frequencies are O(tokens) and left out.

Timing: on CUDA, the kernel alone. Arguments are validated once, outside the timed
region; the timed call is the launch itself (cache address table built beforehand, no
value checks, no host sync), ``BATCH`` launches back to back between two CUDA events, so
host overhead hides behind the GPU work as in serving. Each repetition times copy,
rotate and scatter back to back; the best repetition of each is kept (the least
disturbed). On the CPU each operation is timed by the wall clock; ``OMP_NUM_THREADS=1``
gives steadier figures on a shared machine.

The scatter writes into per-layer caches ``[num_blocks, 16, 8, 128]`` through a slot
mapping of whole 16-slot blocks in shuffled order, as an engine's block allocator hands
them out.

``--sweep`` (CUDA) also times the scatter at other tile shapes (tokens per program x
warps) at 4k and 16k tokens, the measurement ``kernels.triton_rope.tile_for`` should be
set from.

RESULT: ``*_gbps`` at 16k tokens; ``scatter_vs_copy_4k`` / ``_16k`` are copy_time /
scatter_time at 4k and 16k (1.0 = as fast as a copy; the target on an H100/H200 is
>= 0.85), ``scatter_vs_copy`` the lowest over the three sizes.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nopecache.kernels import RopeSpec, rerope_scatter_layers
from nopecache.kernels.api import rotate, validate_scatter_layers

# The RESULT line's keys, in order: tests/bench/test_quick.py checks a --quick run
# prints exactly these.
RESULT_KEYS = (
    "device",
    "rotate_gbps",
    "scatter_gbps",
    "copy_gbps",
    "scatter_vs_copy_4k",
    "scatter_vs_copy_16k",
    "scatter_vs_copy",
)

LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
TOKENS = (1024, 4096, 16384)
MAX_POSITION = 131072
BATCH = 10
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


def _timer(device: torch.device) -> Callable[[Callable[[], None]], float]:
    """Seconds per call of ``fn``: CUDA events around ``BATCH`` calls, or the wall clock."""
    if device.type == "cuda":

        def on_gpu(fn: Callable[[], None]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            for _ in range(BATCH):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / BATCH

        return on_gpu

    def on_cpu(fn: Callable[[], None]) -> float:
        begin = time.perf_counter()
        fn()
        return time.perf_counter() - begin

    return on_cpu


@dataclass(slots=True)
class Case:
    """K, V, positions, slots and caches at one token count, and the operations on them."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    flat_src: torch.Tensor
    flat_dst: torch.Tensor
    rotated: torch.Tensor


def make_case(tokens: int, device: torch.device) -> Case:
    """Random inputs and uninitialised caches for ``tokens`` tokens on ``device``.

    K and V are two halves of one buffer, the caches slices of another, so that the copy
    baseline moves exactly the scatter's bytes without a second copy of them in memory.
    """
    gen = torch.Generator().manual_seed(tokens)
    kv = torch.randn((2, LAYERS, tokens, HEADS, HEAD_DIM), generator=gen)
    kv = kv.to(device=device, dtype=torch.bfloat16)
    positions = torch.randint(0, MAX_POSITION, (tokens,), generator=gen).to(device)
    blocks = tokens // BLOCK_SIZE
    order = torch.randperm(blocks, generator=gen)
    slots = (order[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten().to(device)
    caches = torch.empty(
        (2 * LAYERS, blocks, BLOCK_SIZE, HEADS, HEAD_DIM), dtype=torch.bfloat16, device=device
    )
    return Case(
        kv[0],
        kv[1],
        positions,
        slots,
        list(caches[:LAYERS]),
        list(caches[LAYERS:]),
        kv.view(-1),
        caches.view(-1),
        torch.empty((tokens, HEADS, HEAD_DIM), dtype=torch.bfloat16, device=device),
    )


def scatter_op(case: Case, spec: RopeSpec, tile: object = None) -> Callable[[], None]:
    """The scatter as timed: on CUDA the kernel launch alone (validated here, once)."""
    if case.k.device.type != "cuda":
        return lambda: rerope_scatter_layers(
            case.k, case.v, case.positions, case.slots, case.k_caches, case.v_caches, spec
        )
    from nopecache.kernels.triton_rope import Tile, _address_table, _launch, _rows

    validate_scatter_layers(
        case.k, case.v, case.positions, case.slots, case.k_caches, case.v_caches, spec
    )
    device = case.k.device
    k_table = _address_table(tuple(c.data_ptr() for c in case.k_caches), device)
    v_table = _address_table(tuple(c.data_ptr() for c in case.v_caches), device)
    k_rows, v_rows = _rows(case.k_caches[0]), _rows(case.v_caches[0])
    assert tile is None or isinstance(tile, Tile)

    def launch() -> None:
        _launch(
            spec=spec,
            src=case.k,
            dst_rows=k_rows,
            from_pos=None,
            to_pos=case.positions,
            scale=spec.attention_scaling,
            slots=case.slots,
            copy_pass=True,
            v_src=case.v,
            v_dst_rows=v_rows,
            dst_table=k_table,
            v_dst_table=v_table,
            tile=tile,
        )

    return launch


def _copy(case: Case) -> None:
    case.flat_dst.copy_(case.flat_src)


def measure(tokens: int, spec: RopeSpec, device: torch.device, reps: int) -> Row:
    """Time copy, rotate and rerope_scatter_layers at ``tokens`` tokens."""
    case = make_case(tokens, device)
    timed = _timer(device)

    def rotate_all() -> None:
        for layer in range(LAYERS):
            rotate(case.k[layer], None, case.positions, spec, out=case.rotated, check_values=False)

    ops: dict[str, Callable[[], None]] = {
        "copy": functools.partial(_copy, case),
        "rotate": rotate_all,
        "scatter": scatter_op(case, spec),
    }
    times: dict[str, list[float]] = {name: [] for name in ops}
    for fn in ops.values():  # allocator, Triton compilation, first-touch page faults
        timed(fn)
    for _ in range(reps):
        for name, fn in ops.items():
            times[name].append(timed(fn))
    return Row(tokens, min(times["copy"]), min(times["rotate"]), min(times["scatter"]))


def sweep(spec: RopeSpec, device: torch.device) -> None:
    """Print scatter / copy time at other tile shapes (CUDA only)."""
    from nopecache.kernels.triton_rope import Tile, tile_for

    default = tile_for(spec, HEADS, HEAD_DIM)
    timed = _timer(device)
    for tokens in (4096, 16384):
        case = make_case(tokens, device)
        copy_s = min(timed(functools.partial(_copy, case)) for _ in range(5))
        for block_t in (4, 8, 16, 32):
            for warps in (1, 2, 4, 8):
                tile = Tile(block_t, default.block_h, warps, default.block_copy)
                fn = scatter_op(case, spec, tile)
                timed(fn)
                best = min(timed(fn) for _ in range(5))
                mark = " (default)" if tile == default else ""
                print(
                    f"sweep tokens={tokens} block_t={block_t:2d} warps={warps} "
                    f"copy/scatter={copy_s / best:5.3f}{mark}",
                    flush=True,
                )


def main() -> None:
    """Print one line per token count, then the RESULT line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time other tile shapes")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 1 layer instead of 32, one pass"
    )
    args = parser.parse_args()
    if args.quick:
        # Every size and the RESULT keys stay; a 32nd of the bytes keeps it to seconds.
        global LAYERS
        LAYERS = 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    spec = RopeSpec.from_hf_config(LLAMA3_8B)
    threads = torch.get_num_threads()
    print(f"device={label} threads={threads} layers={LAYERS} heads={HEADS} head_dim={HEAD_DIM}")
    rows = []
    for tokens in TOKENS:
        # Fewer repetitions where one already moves gigabytes (keeps the CPU run short).
        reps = 10 if device.type == "cuda" else {1024: 5, 4096: 3, 16384: 2}[tokens]
        if args.quick:
            reps = 1
        row = measure(tokens, spec, device, reps)
        rows.append(row)
        print(
            f"tokens={tokens:6d} copy {row.gbps(row.copy_s, 4):7.2f} GB/s  "
            f"rotate {row.gbps(row.rotate_s, 2):7.2f} GB/s  "
            f"scatter {row.gbps(row.scatter_s, 4):7.2f} GB/s  "
            f"copy/scatter {row.copy_s / row.scatter_s:5.3f}",
            flush=True,
        )
    if args.sweep and device.type == "cuda":
        sweep(spec, device)
    ratio = {r.tokens: r.copy_s / r.scatter_s for r in rows}
    last = rows[-1]
    print(
        f"RESULT device={device.type} rotate_gbps={last.gbps(last.rotate_s, 2):.2f} "
        f"scatter_gbps={last.gbps(last.scatter_s, 4):.2f} copy_gbps={last.gbps(last.copy_s, 4):.2f} "
        f"scatter_vs_copy_4k={ratio[4096]:.3f} scatter_vs_copy_16k={ratio[16384]:.3f} "
        f"scatter_vs_copy={min(ratio.values()):.3f}"
    )


if __name__ == "__main__":
    main()
