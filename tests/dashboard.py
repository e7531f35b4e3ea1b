"""The Grafana dashboard's PromQL (deploy/grafana/dashboards/art-gateway.json): its expressions and the metric
names they use, for the tests that check them (test_deploy: against promtool and our metrics; test_compose:
against a running Prometheus)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "dashboards" / "art-gateway.json"
METRIC_NAME = re.compile(r"\b(?:artgw_[a-z0-9_]+|vllm:[a-zA-Z0-9_:]+)")


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_expressions() -> list[str]:
    doc = dashboard()
    exprs: list[str] = []

    def panels(items: list[dict[str, Any]]) -> None:
        for panel in items:
            exprs.extend(t["expr"] for t in panel.get("targets") or [] if t.get("expr"))
            panels(panel.get("panels") or [])

    panels(doc.get("panels") or [])
    # Prometheus annotations (promotions and rollbacks); Grafana's built-in one has no expression.
    exprs.extend(a["expr"] for a in (doc.get("annotations") or {}).get("list") or [] if a.get("expr"))
    for var in (doc.get("templating") or {}).get("list") or []:
        query = var.get("query")
        if var.get("type") == "query":
            exprs.append(query["query"] if isinstance(query, dict) else str(query))
    return exprs
