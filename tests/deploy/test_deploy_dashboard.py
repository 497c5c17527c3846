"""deploy/grafana/nopecache-dashboard.json asks only for series the server exports.

The exported series come from the server's own ``ServerMetrics``: every observer and event
method is called once, and the Prometheus text it then serves is parsed back, so the
names carry exactly the suffixes prometheus-client adds (``_total``, ``_bucket``, ``_sum``,
``_count``) and each series its real label names. ``_created`` series are left out: the
server turns them off (``main()`` calls ``disable_created_metrics``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from nopecache.cache_server.metrics import METHODS, METRIC_NAMES, ServerMetrics
from nopecache.cache_server.tiers import TierStats

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "nopecache-dashboard.json"
# Labels Prometheus attaches to every scraped series (plus the operator's target labels).
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "endpoint"}
METRIC = re.compile(r"\bnopecache_[a-z0-9_]+\b")


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """Series name -> label names, as a server with one event of each kind exposes them."""
    metrics = ServerMetrics(version="0.0.0")
    metrics.on_hit("cpu")
    metrics.on_miss()
    metrics.on_eviction("cpu")
    metrics.on_demotion("cpu", "redis")
    metrics.on_promotion("redis", "cpu")
    metrics.on_tier_health("redis", False)
    metrics.rejected("Put", "too_large")
    metrics.put_outcome("stored")
    metrics.put_bytes(1)
    metrics.get_bytes(1)
    metrics.latency[METHODS[0]].observe(0.001)
    metrics.set_tier_stats(
        [
            TierStats(
                name="cpu", url="cpu://", used_bytes=1, capacity_bytes=2, entries=1, healthy=True
            )
        ]
    )
    series: dict[str, set[str]] = {}
    families = set()
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        if family.name.endswith("_created"):
            continue
        families.add(family.name)
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                series.setdefault(sample.name, set()).update(sample.labels)
    # Counters are named without _total in the parsed families; the server's list has it.
    assert {f if f in METRIC_NAMES else f + "_total" for f in families} == set(METRIC_NAMES)
    return series


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    """The dashboard JSON."""
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def targets(dashboard: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(panel title, target) of every query."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield panel["title"], target


def variable_queries(dashboard: dict[str, Any]) -> list[str]:
    """The PromQL of every query variable."""
    out = []
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]
            out.append(query["query"] if isinstance(query, dict) else query)
    return out


def test_exported_series_have_the_client_suffixes(exported: dict[str, set[str]]) -> None:
    assert exported["nopecache_hits_total"] == {"tier"}
    assert exported["nopecache_request_duration_seconds_bucket"] == {"method", "le"}
    assert exported["nopecache_request_duration_seconds_count"] == {"method"}
    assert exported["nopecache_request_duration_seconds_sum"] == {"method"}
    assert exported["nopecache_tier_used_bytes"] == {"tier"}
    assert "nopecache_hits" not in exported


def test_every_metric_in_the_dashboard_is_exported(
    dashboard: dict[str, Any], exported: dict[str, set[str]]
) -> None:
    exprs = [t["expr"] for _, t in targets(dashboard)] + variable_queries(dashboard)
    used = {name for expr in exprs for name in METRIC.findall(expr)}
    assert used, "no nopecache metric found in the dashboard"
    assert used - set(exported) == set()
    # Most of what the server exports is on the dashboard.
    assert {m.removesuffix("_bucket") for m in used} >= {
        m for m in exported if not m.endswith(("_bucket", "_sum", "_count", "_info"))
    } - {"nopecache_request_duration_seconds"}


def test_grouping_and_legend_labels_exist_on_the_queried_metrics(
    dashboard: dict[str, Any], exported: dict[str, set[str]]
) -> None:
    for title, target in targets(dashboard):
        expr = target["expr"]
        labels = set(TARGET_LABELS)
        for name in METRIC.findall(expr):
            labels |= exported[name]
        grouped = {
            label.strip()
            for clause in re.findall(r"\b(?:by|ignoring|on)\s*\(([^)]*)\)", expr)
            for label in clause.split(",")
            if label.strip()
        }
        legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
        assert grouped | legend <= labels, (title, (grouped | legend) - labels)


def test_queries_are_balanced_and_filter_by_the_variables(dashboard: dict[str, Any]) -> None:
    for title, target in targets(dashboard):
        expr = target["expr"]
        for opening, closing in ("()", "{}", "[]"):
            assert expr.count(opening) == expr.count(closing), (title, expr)
        for selector in re.findall(r"nopecache_[a-z0-9_]+(\{[^}]*\})?", expr):
            assert selector == '{job=~"$job", instance=~"$instance"}', (title, expr)
        assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_covers_hit_rate_by_tier_bytes_per_tier_evictions_and_latency(
    dashboard: dict[str, Any],
) -> None:
    exprs = [t["expr"] for _, t in targets(dashboard)]

    def some(*patterns: str) -> bool:
        return any(all(re.search(p, e) for p in patterns) for e in exprs)

    assert some(r"sum by \(tier\) \(rate\(nopecache_hits_total", r"nopecache_misses_total")
    assert some(r"sum by \(tier\) \(nopecache_tier_used_bytes")
    assert some(r"nopecache_tier_capacity_bytes")
    assert some(r"sum by \(tier\) \(rate\(nopecache_evictions_total")
    assert some(
        r"histogram_quantile\(0\.99, sum by \(le, method\) \(rate\(nopecache_request_duration_seconds_bucket"
    )


def test_layout_is_a_valid_grafana_dashboard(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "nopecache-overview"
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in panels(dashboard):
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        area = {(pos["x"] + dx, pos["y"] + dy) for dx in range(pos["w"]) for dy in range(pos["h"])}
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
    names = [v["name"] for v in dashboard["templating"]["list"]]
    assert names == ["datasource", "job", "instance"]
