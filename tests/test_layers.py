"""Layers point one way (the design's import direction), checked on the source: every
import in every module under nopecache/ (at module level, inside functions, under
``TYPE_CHECKING``, ``importlib.import_module`` of a literal name), parsed with ``ast``,
never executed.

    kernels, proto     import nothing else of nopecache
    cache_server       never imports client, kernels, recompute or an integration
    client             never imports cache_server or an integration
    recompute          imports no integration and no cache_server
    admin              (nopecache-admin) a client of the wire contract: never imports
                       cache_server, recompute or an integration
    integrations/X     imports no other integration
    an engine          (vllm, sglang) is imported only inside integrations/<engine>/, and
                       in integrations/vllm/ at run time only by connector.py, metrics.py
                       and compat.py (the rest use vLLM's types under TYPE_CHECKING only)
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "nopecache"
ENGINES = ("vllm", "sglang")

# Layer -> the layers it must not import ("integrations" stands for every integration).
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "cache_server": ("client", "kernels", "recompute", "integrations"),
    "client": ("cache_server", "integrations"),
    "recompute": ("cache_server", "integrations"),
    "admin": ("cache_server", "recompute", "integrations"),
}
# Layers that import nothing of nopecache but themselves.
LEAVES = ("kernels", "proto")
# The modules of integrations/vllm/ that may import vLLM at run time: the facade vLLM
# loads, the stats vLLM aggregates, and the one module that reaches into its internals.
VLLM_RUNTIME = ("connector.py", "metrics.py", "compat.py")

# (file, imported module or package) pairs that break a rule on purpose, each with its why.
EXCEPTIONS: tuple[tuple[str, str], ...] = (
    # Configs written before integrations/ existed name the connector by its old path;
    # this module re-exports it from the new one (see its docstring).
    ("nopecache/client/adapters/vllm.py", "nopecache.integrations.vllm"),
)


@dataclass(frozen=True, slots=True)
class Import:
    """One import statement's target, where it is, and whether it runs."""

    path: str  # relative to the checked root, with "/"
    line: int
    target: str  # dotted, absolute
    runtime: bool  # False under `if TYPE_CHECKING:`


def module_name(rel: Path) -> str:
    """The dotted module of a file path relative to the root (a package is its __init__)."""
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Collector(ast.NodeVisitor):
    """Every import target of one module, relative imports resolved."""

    def __init__(self, path: str, package: str) -> None:
        self.path = path
        self.package = package  # the package relative imports start from
        self.found: list[Import] = []
        self._type_only = 0

    def _add(self, node: ast.AST, target: str) -> None:
        line = getattr(node, "lineno", 0)
        self.found.append(Import(self.path, line, target, runtime=self._type_only == 0))

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self._type_only += 1
        for child in node.body:
            self.visit(child)
        self._type_only -= 1
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parts = self.package.split(".")
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join([*parts, *([node.module] if node.module else [])])
        for alias in node.names:
            # `from a import b` may name module a.b; a.b's layer is a's layer or finer.
            self._add(node, base if alias.name == "*" else f"{base}.{alias.name}")

    def visit_Call(self, node: ast.Call) -> None:
        name = getattr(node.func, "attr", getattr(node.func, "id", ""))
        if name in ("import_module", "__import__") and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                self._add(node, first.value)
        self.generic_visit(node)


def imports_under(root: Path) -> list[Import]:
    """Every import of every module in ``root/nopecache``."""
    found: list[Import] = []
    for file in sorted((root / PACKAGE).rglob("*.py")):
        rel = file.relative_to(root)
        module = module_name(rel)
        package = module if file.name == "__init__.py" else module.rpartition(".")[0]
        collector = _Collector(rel.as_posix(), package)
        collector.visit(ast.parse(file.read_text(), filename=str(file)))
        found.extend(collector.found)
    return found


def layer_of(dotted: str) -> str:
    """``client``, ``integrations.vllm``, ...; "" for the package root, the name's top
    level for anything not ours."""
    parts = dotted.split(".")
    if parts[0] != PACKAGE:
        return parts[0]
    if len(parts) == 1:
        return ""
    if parts[1] == "integrations" and len(parts) > 2:
        return f"integrations.{parts[2]}"
    return parts[1]


def _broken_rule(imp: Import) -> str | None:
    """The rule ``imp`` breaks, if any."""
    source = layer_of(module_name(Path(imp.path)))
    target = layer_of(imp.target)
    engine = imp.target.split(".")[0]
    if engine in ENGINES:
        home = f"{PACKAGE}/integrations/{engine}/"
        if not imp.path.startswith(home):
            return f"only {home} imports {engine}"
        if engine == "vllm" and imp.runtime and Path(imp.path).name not in VLLM_RUNTIME:
            return f"only {', '.join(VLLM_RUNTIME)} import vllm at run time"
        return None
    if not imp.target.startswith(f"{PACKAGE}.") or target == source:
        return None
    if source in LEAVES:
        return f"{source} imports nothing else of {PACKAGE}"
    family = "integrations" if target.startswith("integrations") else target
    if family in FORBIDDEN.get(source, ()):
        return f"{source} never imports {target}"
    if source.startswith("integrations.") and target.startswith("integrations."):
        return "no integration imports another"
    return None


def _excepted(imp: Import) -> bool:
    return any(
        imp.path == path and (imp.target == name or imp.target.startswith(f"{name}."))
        for path, name in EXCEPTIONS
    )


def violations(root: Path) -> list[str]:
    """``path:line: target (rule)`` for every import under ``root`` that breaks a rule."""
    out = []
    for imp in imports_under(root):
        rule = _broken_rule(imp)
        if rule is not None and not _excepted(imp):
            out.append(f"{imp.path}:{imp.line}: {imp.target} ({rule})")
    return out


# -- the tree ----------------------------------------------------------------------------------
def test_nopecache_imports_point_one_way() -> None:
    assert violations(ROOT) == []


def test_the_checker_reads_the_whole_tree() -> None:
    # Not vacuous: every file with an import statement is parsed, and the allowed
    # directions are seen.
    statement = re.compile(r"^\s*(from\s+\S+\s+)?import\s", re.MULTILINE)
    files = {
        f.relative_to(ROOT).as_posix()
        for f in (ROOT / PACKAGE).rglob("*.py")
        if statement.search(f.read_text())
    }
    found = imports_under(ROOT)
    assert len(files) > 50 and {i.path for i in found} == files
    seen = {(layer_of(module_name(Path(i.path))), layer_of(i.target)) for i in found}
    assert {("client", "kernels"), ("client", "proto"), ("cache_server", "proto")} <= seen
    assert ("integrations.vllm", "vllm") in seen


# -- the checker -------------------------------------------------------------------------------
SYNTHETIC = {
    "kernels/rope.py": "from nopecache.client import keys\n",
    "proto/block.py": "def f():\n    import nopecache.kernels.api\n",
    "cache_server/store.py": "from ..client import plan\nfrom nopecache.proto import wire\n",
    "cache_server/tiers/cpu.py": "from ...recompute import policies\n",
    "client/plan.py": (
        "from typing import TYPE_CHECKING\n"
        "from nopecache.kernels import api\n"
        "if TYPE_CHECKING:\n"
        "    from nopecache.cache_server.store import TieredStore\n"
    ),
    "client/adapters/vllm.py": "from nopecache.integrations.vllm.connector import C\n",
    "client/adapters/hf.py": "from nopecache.integrations.hf import adapter\n",
    "client/discovery.py": "import importlib\nimportlib.import_module('sglang.srt')\n",
    "recompute/selective.py": (
        "from nopecache.client.chunking import ChunkSpan\n"
        "from nopecache.integrations.hf.forward import run\n"
    ),
    "integrations/hf/adapter.py": (
        "import vllm\nfrom nopecache.client import CacheClient\n"
        "from nopecache.integrations.vllm.config import ConnectorConfig\n"
    ),
    "integrations/vllm/scheduler.py": (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from vllm.v1.request import Request\n"
        "def f():\n"
        "    import vllm.config\n"
    ),
    "integrations/vllm/compat.py": "def f():\n    from vllm.platforms import current_platform\n",
    "integrations/vllm/connector.py": "from vllm.config import VllmConfig\n",
    "integrations/vllm/metrics.py": "from . import compat\nimport vllm\n",
}


def test_each_rule_catches_its_violation(tmp_path: Path) -> None:
    for rel, source in SYNTHETIC.items():
        path = tmp_path / PACKAGE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    runtime = "connector.py, metrics.py, compat.py"
    assert violations(tmp_path) == [
        "nopecache/cache_server/store.py:1: nopecache.client.plan "
        "(cache_server never imports client)",
        "nopecache/cache_server/tiers/cpu.py:1: nopecache.recompute.policies "
        "(cache_server never imports recompute)",
        "nopecache/client/adapters/hf.py:1: nopecache.integrations.hf.adapter "
        "(client never imports integrations.hf)",
        "nopecache/client/discovery.py:2: sglang.srt (only nopecache/integrations/sglang/ "
        "imports sglang)",
        "nopecache/client/plan.py:4: nopecache.cache_server.store.TieredStore "
        "(client never imports cache_server)",
        "nopecache/integrations/hf/adapter.py:1: vllm (only nopecache/integrations/vllm/ "
        "imports vllm)",
        "nopecache/integrations/hf/adapter.py:3: nopecache.integrations.vllm.config."
        "ConnectorConfig (no integration imports another)",
        f"nopecache/integrations/vllm/scheduler.py:5: vllm.config (only {runtime} import "
        "vllm at run time)",
        "nopecache/kernels/rope.py:1: nopecache.client.keys (kernels imports nothing else "
        "of nopecache)",
        "nopecache/proto/block.py:2: nopecache.kernels.api (proto imports nothing else of "
        "nopecache)",
        "nopecache/recompute/selective.py:2: nopecache.integrations.hf.forward.run "
        "(recompute never imports integrations.hf)",
    ]
