"""Both module paths of the connector resolve through vLLM's own connector factory.

``kv_connector_module_path="nopecache.client.adapters.vllm"`` (configs written before
the connector moved) must keep loading, saying once that it moved; the new path
``nopecache.integrations.vllm`` must give the same class. vLLM resolves the class the
same way before it starts an engine, so no engine is started here.
"""

from __future__ import annotations

import logging
import sys

import pytest
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from nopecache.integrations.vllm.connector import NopecacheConnector

OLD = "nopecache.client.adapters.vllm"
NEW = "nopecache.integrations.vllm"


def _transfer(module_path: str) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="NopecacheConnector",
        kv_connector_module_path=module_path,
        kv_role="kv_both",
        kv_connector_extra_config={"url": "nopecache://127.0.0.1:1"},
    )


def test_old_path_loads_through_vllms_factory_and_says_once_that_it_moved(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delitem(sys.modules, OLD, raising=False)  # import it afresh, as vLLM would
    with caplog.at_level(logging.WARNING, logger=f"vllm.{OLD}"):
        first = KVConnectorFactory.get_connector_class(_transfer(OLD))
        again = KVConnectorFactory.get_connector_class(_transfer(OLD))
    assert first is NopecacheConnector and again is NopecacheConnector
    moved = [r.getMessage() for r in caplog.records if r.name == f"vllm.{OLD}"]
    assert moved == [
        "nopecache.client.adapters.vllm moved to nopecache.integrations.vllm: "
        "set kv_connector_module_path to the new path (the old one keeps working)"
    ]


def test_new_path_resolves_to_the_same_class_without_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        cls = KVConnectorFactory.get_connector_class(_transfer(NEW))
    assert cls is NopecacheConnector
    assert cls.__module__ == f"{NEW}.connector"
    assert not [r for r in caplog.records if "moved to" in r.getMessage()]
