"""RoPE math for nopecache: specs from model configs and K rotation kernels."""

from nopecache.kernels.rope_spec import RopeSpec

__all__ = ["RopeSpec"]
