"""RoPE math for nopecache: specs from model configs and K rotation kernels.

The public kernels are ``nopecache.kernels.api.rotate``, ``rerope_scatter`` and
``rerope_scatter_layers`` (the last two also exported here). ``rotate`` is imported from
``api`` because ``nopecache.kernels.rotate`` names the Triton module: a package attribute
of the same name would be replaced by that module the first time it is imported.
"""

from nopecache.kernels.api import Positions, rerope_scatter, rerope_scatter_layers
from nopecache.kernels.rope_spec import RopeSpec

__all__ = ["Positions", "RopeSpec", "rerope_scatter", "rerope_scatter_layers"]
