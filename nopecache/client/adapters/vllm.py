"""The vLLM connector's old path (``nopecache.client.adapters.vllm``), a re-export.

Configs written before the move name this module in ``kv_connector_module_path``; it
keeps working and logs once that the connector moved to ``nopecache.integrations.vllm``.
"""

from __future__ import annotations

import logging

from nopecache.integrations.vllm.connector import NopecacheConnector, NopecacheConnectorMetadata
from nopecache.integrations.vllm.errors import (
    ConnectorConfigError,
    UnsupportedEngineError,
    UnsupportedLayoutError,
)
from nopecache.integrations.vllm.metrics import NopecacheStats

__all__ = [
    "ConnectorConfigError",
    "NopecacheConnector",
    "NopecacheConnectorMetadata",
    "NopecacheStats",
    "UnsupportedEngineError",
    "UnsupportedLayoutError",
]

MOVED = (
    "nopecache.client.adapters.vllm moved to nopecache.integrations.vllm: "
    "set kv_connector_module_path to the new path (the old one keeps working)"
)

logging.getLogger(f"vllm.{__name__}").warning(MOVED)
