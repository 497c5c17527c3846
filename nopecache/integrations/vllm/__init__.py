"""nopecache as a vLLM v1 KV connector (``kv_connector_module_path="nopecache.integrations.vllm"``).

The package's modules other than ``connector`` and ``compat`` import nothing of vLLM, so
the connector's halves are testable without it; ``NopecacheConnector`` is imported from
``connector`` only when vLLM asks for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nopecache.integrations.vllm.connector import NopecacheConnector

__all__ = ["NopecacheConnector"]


def __getattr__(name: str) -> Any:
    """vLLM's ``getattr(module, kv_connector)``: the connector class, imported on demand."""
    if name == "NopecacheConnector":
        from nopecache.integrations.vllm.connector import NopecacheConnector

        return NopecacheConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
