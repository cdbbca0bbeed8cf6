"""The chart's PrometheusRule and Grafana dashboard, as the pinned helm renders them.

Covers: the rule file passes ``promtool check rules`` (the Debian package's
promtool); the PrometheusRule's spec is that file's groups, verbatim, with
the extra labels a Prometheus selects on; the dashboard ConfigMap carries the
dashboard JSON unchanged, with the Grafana sidecar's label; both are off by
default (their CRD / sidecar may not exist) and off with ``metrics.enabled``
false. Whether the rules evaluate and the queries return series against a
real Prometheus: tests/integration/operator/test_prometheus.py.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
from typing import Any

import yaml

from . import helmtools

FILES = helmtools.CHART / "files"


def render(helm: pathlib.Path, values: dict[str, str]) -> list[dict[str, Any]]:
    return helmtools.documents(helmtools.template(helm, namespace="cairn-system", values=values))


def kinds(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d.get("kind") == kind]


def test_promtool_accepts_the_rules() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "no promtool: apt-get install prometheus (scripts/bootstrap does it)"
    result = subprocess.run(
        [promtool, "check", "rules", str(FILES / "prometheus-rules.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 5 rules found" in result.stdout


def test_rule_and_dashboard_render(helm: pathlib.Path) -> None:
    docs = render(
        helm,
        {
            "metrics.prometheusRule.enabled": "true",
            "metrics.prometheusRule.labels.release": "kube-prometheus",
            "metrics.grafanaDashboard.enabled": "true",
        },
    )
    [rule] = kinds(docs, "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((FILES / "prometheus-rules.yaml").read_text())
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus"
    [board] = [d for d in kinds(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((FILES / "grafana-dashboard.json").read_text())
    assert json.loads(board["data"]["cairn.json"]) == shipped


def test_off_by_default_and_without_metrics(helm: pathlib.Path) -> None:
    for values in ({}, {"metrics.enabled": "false", "metrics.prometheusRule.enabled": "true"}):
        docs = render(helm, values)
        assert kinds(docs, "PrometheusRule") == []
        assert not [d for d in kinds(docs, "ConfigMap") if "dashboard" in d["metadata"]["name"]]
