"""SGLang's modules on a CPU-only torch: the one step importing them needs here.

``sglang.srt.configs`` imports torchvision, and PyPI's torchvision is built against CUDA
torch: on CPU torch its C++ ops library does not load, and its import then fails
registering fake kernels for two ops that library would have defined
(``torchvision::nms``/``qnms``; torchvision guards its other registrations, not these).
Defining those two op schemas first lets torchvision import with its ops absent, as it is
designed to; nothing here or in SGLang's memory-cache code calls them. A GPU deployment
has the matching CUDA torch and never runs this.
"""

from __future__ import annotations

import torch

__all__ = ["prepare_sglang_import"]

_MISSING_OPS = {
    "nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_done = False


def prepare_sglang_import() -> None:
    """Make ``import sglang.srt...`` work on CPU torch (idempotent; no-op with CUDA torch)."""
    global _done
    if _done or torch.cuda.is_available():
        return
    for name, schema in _MISSING_OPS.items():
        try:
            torch.ops.torchvision.__getattr__(name)
        except (AttributeError, RuntimeError):
            torch.library.define(f"torchvision::{name}", schema)
    _done = True
