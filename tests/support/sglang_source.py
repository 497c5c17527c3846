"""SGLang code from modules that do not import in ``.venv-sglang``, run from its installed source.

``sglang.srt.managers.schedule_batch`` (``Req``, ``MultimodalDataItem``) imports SGLang's
grammar backends and OpenAI protocol types, a dependency tree (openai, xgrammar, opencv,
mistral-common, ...) the CPU environment leaves out (``requirements-sglang.txt``). The page
identity tests need a few of its pure functions and statements, not that tree, so they read
them from the installed source: :func:`sglang_function` runs one module-level function with
the module's constant assignments (SGLang's code, not a copy: an upgrade that changes it
changes what the tests run), :func:`method_statements` returns a method's statements as
source text for the tests that pin how SGLang builds a key.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["method_statements", "sglang_function"]

_CONSTANT_NODES = (
    ast.Constant,
    ast.BinOp,
    ast.UnaryOp,
    ast.Name,
    ast.Load,
    ast.operator,
    ast.unaryop,
)


def _module_tree(module: str) -> ast.Module:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(module)
    return ast.parse(Path(spec.origin).read_text(encoding="utf-8"), filename=spec.origin)


def sglang_function(module: str, name: str, **env: Any) -> Callable[..., Any]:
    """Function ``name`` of SGLang's ``module``, executed from its installed source with the
    module's constant assignments and ``env`` (the stdlib modules it uses) as globals."""
    tree = _module_tree(module)
    known: set[str] = set()
    body: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            parts = list(ast.walk(node.value))
            names = {n.id for n in parts if isinstance(n, ast.Name)}
            if all(isinstance(n, _CONSTANT_NODES) for n in parts) and names <= known:
                body.append(node)
                known.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.FunctionDef) and node.name == name:
            body.append(node)
    if not any(isinstance(n, ast.FunctionDef) for n in body):
        raise AttributeError(f"{module} has no function {name}")
    namespace: dict[str, Any] = dict(env)
    exec(compile(ast.Module(body=body, type_ignores=[]), module, "exec"), namespace)
    function: Callable[..., Any] = namespace[name]
    return function


def method_statements(module: str, cls: str, method: str) -> list[str]:
    """The statements of ``cls.method`` in SGLang's ``module`` (nested ones included), each
    as normalized source text (``ast.unparse``)."""
    for node in _module_tree(module).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == method:
                    return [
                        ast.unparse(n)
                        for fn in item.body
                        for n in ast.walk(fn)
                        if isinstance(n, ast.stmt)
                    ]
    raise AttributeError(f"{module} has no method {cls}.{method}")
