"""The package layout: every folder is importable under the nopecache namespace only."""

import importlib
import importlib.util

import pytest


@pytest.mark.parametrize("name", ["kernels", "client", "proto", "cache_server"])
def test_subpackage_imports_under_namespace(name: str) -> None:
    mod = importlib.import_module(f"nopecache.{name}")
    assert mod.__name__ == f"nopecache.{name}"


@pytest.mark.parametrize("name", ["kernels", "client", "proto", "cache_server"])
def test_no_bare_top_level_package_installed(name: str) -> None:
    spec = importlib.util.find_spec(name)
    # Running from the repository root may expose the folder itself; an installed
    # bare package would live in site-packages.
    assert spec is None or "site-packages" not in (spec.origin or "")
