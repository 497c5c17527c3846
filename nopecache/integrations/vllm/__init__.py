"""nopecache as a vLLM v1 KV connector (``kv_connector_module_path="nopecache.integrations.vllm"``).

Only ``connector`` (the facade) and ``metrics`` import vLLM when imported, and only its
public connector API (``kv_connector.v1.base`` and ``.metrics``); ``compat`` reaches into
vLLM's internals inside its functions. So the connector's halves and everything they use
import, and are tested, without vLLM; ``NopecacheConnector`` is imported from
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
