"""deploy/grafana/vllm-connector-dashboard.json asks only for the connector's own counters,
and shows every one of them.

The names come from the connector's Prometheus class (``NopecachePromMetrics``), whose
counters vLLM exports as ``vllm:nopecache_<key>_total`` with vLLM's labels
(``model_name``, ``engine``). No engine is started.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from nopecache.integrations.vllm.metrics import NopecachePromMetrics

DASHBOARD = (
    Path(__file__).resolve().parents[4] / "deploy" / "grafana" / "vllm-connector-dashboard.json"
)
SERIES = re.compile(r"vllm:nopecache_([a-z0-9_]+?)_total\{([^}]*)\}")
VLLM_LABELS = {"model_name", "engine"}


def _exprs() -> list[str]:
    data = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in data["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in data["templating"]["list"] if "definition" in v]
    return exprs


def test_the_dashboard_names_only_exported_counters_and_every_one() -> None:
    counters = set(NopecachePromMetrics._COUNTERS)
    used: set[str] = set()
    for expr in _exprs():
        for key, labels in SERIES.findall(expr):
            assert key in counters, f"{key} is not a connector counter: {expr}"
            names = {part.split("=")[0].strip() for part in labels.split(",") if part.strip()}
            assert names <= VLLM_LABELS, expr
            used.add(key)
        bare = re.findall(r"vllm:nopecache_[a-z0-9_]+(?!_total)\b", expr)
        assert all(name.endswith("_total") for name in bare), expr
    assert used == counters
