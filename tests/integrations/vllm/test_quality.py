"""The production blend check's sampling and idle wait (quality.py), without a model."""

from __future__ import annotations

import pytest

from nopecache.client.errors import InvalidArgumentError
from nopecache.integrations.vllm.quality import ShareSampler


@pytest.mark.parametrize(("share", "every"), [(1.0, 1), (0.5, 2), (0.25, 4), (0.01, 100)])
def test_the_sampler_takes_every_nth(share: float, every: int) -> None:
    sampler = ShareSampler(share)
    taken = [i for i in range(1, 4 * every + 1) if sampler.take()]
    assert taken == [every, 2 * every, 3 * every, 4 * every]


def test_share_zero_never_samples() -> None:
    sampler = ShareSampler(0)
    assert not any(sampler.take() for _ in range(10_000))


@pytest.mark.parametrize("share", [-0.01, 1.01, True, "0.1", float("nan")])
def test_the_sampler_refuses_a_share_outside_zero_one(share: object) -> None:
    with pytest.raises(InvalidArgumentError, match="blend_check_share"):
        ShareSampler(share)  # type: ignore[arg-type]
