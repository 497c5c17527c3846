"""Absurd client settings are refused with an error naming the parameter (issue 25):
timeouts and back-offs far outside any sane range used to be accepted and then silently
miss every call (a 1e-12 s deadline) or never end one (1e10 s), and ``down_backoff=1e300``
or a one-token average chunk raised a bare ``OverflowError`` somewhere deep."""

from __future__ import annotations

import pytest

from nopecache.client.config import ClientConfig, RetryPolicy
from nopecache.client.errors import InvalidArgumentError

URL = "nopecache://cache:50551?"


@pytest.mark.parametrize(
    ("query", "argument"),
    [
        ("lookup_timeout=1e10", "lookup_timeout"),
        ("get_timeout=1e-12", "get_timeout"),
        ("put_timeout=1e10", "put_timeout"),
        ("control_timeout=1e-12", "control_timeout"),
        ("connect_timeout=1e10", "connect_timeout"),
        ("down_backoff=1e300", "down_backoff"),
        ("dns_refresh=1e300", "dns_refresh"),
        ("dns_min_interval=1e300", "dns_min_interval"),
        ("retry_initial_backoff=1e-300", "retry_initial_backoff"),
        ("retry_max_backoff=1e300", "retry_max_backoff"),
        ("retry_backoff_multiplier=1e300", "retry_backoff_multiplier"),
        ("retry_throttle_token_ratio=1e300", "retry_throttle_token_ratio"),
        ("chunk_min_tokens=1&chunk_avg_tokens=1&chunk_max_tokens=2", "chunk_avg_tokens"),
    ],
)
def test_an_absurd_url_value_is_refused_naming_the_parameter(query: str, argument: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        ClientConfig.from_url(URL + query)
    assert err.value.argument == argument
    assert "must be" in err.value.reason


@pytest.mark.parametrize(
    ("changes", "argument"),
    [
        ({"lookup_timeout_s": 1e10}, "lookup_timeout_s"),
        ({"get_timeout_s": 1e-12}, "get_timeout_s"),
        ({"down_backoff_s": 1e300}, "down_backoff_s"),
        ({"chunk_min_tokens": 1, "chunk_avg_tokens": 1, "chunk_max_tokens": 2}, "chunk_avg_tokens"),
    ],
)
def test_an_absurd_field_is_refused_naming_it(changes: dict[str, object], argument: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        ClientConfig(servers=("cache:50551",), **changes)  # type: ignore[arg-type]
    assert err.value.argument == argument


@pytest.mark.parametrize(
    ("changes", "argument"),
    [
        ({"initial_backoff_s": 1e-300}, "retry.initial_backoff_s"),
        ({"initial_backoff_s": 1.0, "max_backoff_s": 1e300}, "retry.max_backoff_s"),
    ],
)
def test_an_absurd_retry_backoff_is_refused_naming_it(
    changes: dict[str, object], argument: str
) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        RetryPolicy(**changes)  # type: ignore[arg-type]
    assert err.value.argument == argument


def test_the_edges_of_the_ranges_are_accepted() -> None:
    config = ClientConfig.from_url(
        URL + "lookup_timeout=1ms&put_timeout=86400&down_backoff=3600&dns_refresh=0"
    )
    assert (config.lookup_timeout_s, config.put_timeout_s) == (0.001, 86400.0)
    assert (config.down_backoff_s, config.dns_refresh_s) == (3600.0, 0.0)
