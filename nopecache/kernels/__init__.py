"""RoPE math for nopecache: specs from model configs and K rotation kernels.

``rotate``, ``rerope_scatter`` and ``rerope_scatter_layers`` dispatch on the device:
CUDA tensors run the Triton kernels of ``nopecache.kernels.triton_rope``, any other
device the plain-torch code of ``nopecache.kernels.reference``.
"""

from nopecache.kernels.api import Positions, rerope_scatter, rerope_scatter_layers, rotate
from nopecache.kernels.rope_spec import RopeSpec

__all__ = ["Positions", "RopeSpec", "rerope_scatter", "rerope_scatter_layers", "rotate"]
