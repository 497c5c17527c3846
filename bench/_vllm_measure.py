"""What the vLLM benchmarks measure on an engine's logprobs: KL and top-1 against a reference.

Logprobs come from ``tests/support/engine_proc.py`` as ``{token id (str): logprob}`` over an
engine's top tokens at one position.
"""

from __future__ import annotations

import math


def kl_top1(ref: dict[str, float], got: dict[str, float], target: int) -> tuple[float, bool]:
    """KL(ref || got) over ref's top tokens (got's floor where it lacks one), top-1 match.

    ``target`` is the token the reference chose (its greedy token): the match says whether
    ``got``'s most likely token is that one.
    """
    floor = min(got.values())
    kl = sum(math.exp(lp) * (lp - got.get(tok, floor)) for tok, lp in ref.items())
    best = max(got, key=lambda tok: got[tok])
    return max(kl, 0.0), int(best) == target
