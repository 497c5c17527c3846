"""Counts the placement kernel's calls in every process of a vLLM engine (tests only).

A test puts this folder first on an engine's ``PYTHONPATH`` with ``NOPECACHE_KERNEL_PROBE``
naming a file (``kernel_probe.probe_env``). Python imports ``sitecustomize`` at start-up
in each process, vLLM's engine-core and worker processes included; this one waits for
``nopecache.client.placement`` to be imported (an import hook: nothing is imported early,
so the engine starts as it always does) and wraps its ``rerope_scatter_layers``: each
call appends one line ``pid mode slots`` to the file (mode ``nope``: nope K rotated to
its target; ``same``: post-RoPE K copied at its own positions; ``moved``: post-RoPE K
rotated by a difference; slots: how many cache slots the call writes), then runs the
real kernel.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any

_TARGET = "nopecache.client.placement"


def _wrap(module: Any, path: str) -> None:
    real = module.rerope_scatter_layers

    def counted(*args: Any, **kwargs: Any) -> None:
        positions, slots = args[2], args[3]
        source = kwargs.get("from_positions")
        if source is None:
            mode = "nope"
        elif isinstance(source, int) and source == positions:
            mode = "same"
        else:
            mode = "moved"
        written = int((slots >= 0).sum())
        real(*args, **kwargs)
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {mode} {written}\n")

    module.rerope_scatter_layers = counted


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, path: str) -> None:
        self.inner, self.path = inner, path

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        _wrap(module, self.path)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, path: str) -> None:
        self.path = path

    def find_spec(self, name: str, import_path: Any, target: Any = None) -> Any:
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, import_path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, self.path)
        return spec


if os.environ.get("NOPECACHE_KERNEL_PROBE"):
    sys.meta_path.insert(0, _Finder(os.environ["NOPECACHE_KERNEL_PROBE"]))
