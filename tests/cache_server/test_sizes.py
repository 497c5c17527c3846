"""Byte-size parsing: units, exactness, and errors that name the field."""

from __future__ import annotations

import pytest

from nopecache.cache_server.sizes import SizeError, format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GiB", 8 * 1024**3),
        ("512MiB", 512 * 1024**2),
        ("1000000", 1_000_000),
        ("0", 0),
        ("1.5KiB", 1536),
        ("10MB", 10_000_000),
        ("1.1GB", 1_100_000_000),
        ("2Gi", 2 * 1024**3),
        ("64kib", 65536),
        (" 3 TiB ", 3 * 1024**4),
        ("7B", 7),
        ("4k", 4000),
    ],
)
def test_parse_size_accepts_binary_and_decimal_units(text: str, expected: int) -> None:
    assert parse_size(text, field="capacity") == expected


def test_parse_size_passes_ints_through() -> None:
    assert parse_size(123, field="capacity") == 123


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("", "cannot parse ''"),
        ("abc", "cannot parse 'abc'"),
        ("-1", "cannot parse '-1'"),
        ("8XB", "unknown unit 'XB'"),
        ("1.3B", "not a whole number of bytes"),
        ("0.1KiB", "not a whole number of bytes"),
        ("1e9", "cannot parse '1e9'"),
        (-5, "cannot be negative"),
        (True, "boolean"),
    ],
)
def test_parse_size_errors_name_the_field(value: str | int, fragment: str) -> None:
    with pytest.raises(SizeError) as info:
        parse_size(value, field="tiers.cpu.capacity")
    message = str(info.value)
    assert message.startswith("tiers.cpu.capacity: ")
    assert fragment in message


def test_size_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"^x: "):
        parse_size("nope", field="x")


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0B"), (1, "1B"), (1536, "1536B"), (65536, "64KiB"), (3 * 1024**3, "3GiB")],
)
def test_format_size_round_trips(n: int, text: str) -> None:
    assert format_size(n) == text
    assert parse_size(text, field="n") == n
