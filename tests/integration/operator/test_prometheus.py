"""A real Prometheus scrapes the devcluster's operator and evaluates the chart's rules.

Prometheus is the Debian package's binary (``cairn.devcluster.prometheus``),
configured with the chart's own rule file (``charts/cairn/files/
prometheus-rules.yaml``, which the chart's PrometheusRule embeds verbatim).
A suspended job (no pods) gets writer-style status patches: a commit of step
5 with its write and stall seconds, then a commit of step 10 with the upload
of step 5. Covers: the operator observes each new step once into the
``cairn_checkpoint_*_seconds`` histograms (write 1.5 s, stall 0.25 s, upload
4 s: the seconds between step 5's commit and upload times); every rule loads
and evaluates healthy with no error in ``/api/v1/rules``; every query of the
chart's Grafana dashboard returns series; ``cairn_build_info`` and
``cairn_leader 1`` are scraped. A standby (a replica waiting for a Lease
another holds) serves ``cairn_leader 0``, the build info, and no job series
(not the zeros that made alerts on the standby fire).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import pathlib
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from cairn.devcluster import prometheus
from tests.conftest import DevclusterHandle, OperatorProcess
from tests.integration.devcluster import kube_helpers as kh

pytestmark = pytest.mark.cluster

GROUP, VERSION, PLURAL = "cairn.dev", "v1alpha1", "trainingjobs"
CHART_FILES = pathlib.Path(__file__).resolve().parents[3] / "charts" / "cairn" / "files"
RULES = CHART_FILES / "prometheus-rules.yaml"
DASHBOARD = CHART_FILES / "grafana-dashboard.json"
OPERATOR_METRICS = "127.0.0.1:9090"
"""Where the devcluster's operator serves /metrics (its default port, tests/demo.py)."""
WAIT = 60.0
NEVER = "0001-01-01T00:00:00Z"
"""Prometheus's lastEvaluation of a rule not evaluated yet."""


@pytest.fixture
def namespace(devcluster: DevclusterHandle) -> Iterator[str]:
    with contextlib.contextmanager(kh.temp_namespace)(devcluster.core, prefix="prom") as name:
        yield name


@pytest.fixture
def server(devcluster: DevclusterHandle, tmp_path: pathlib.Path) -> Iterator[prometheus.Server]:
    running = prometheus.start(
        workdir=tmp_path / "prometheus",
        targets=[OPERATOR_METRICS],
        rule_files=[RULES],
        pidfile=devcluster.target.state.pidfile(f"prometheus-{tmp_path.name}"),
    )
    try:
        yield running
    finally:
        running.stop()


def dashboard_queries(namespace: str) -> list[str]:
    """Every panel query, with Grafana's variables as Grafana would fill them."""
    board = json.loads(DASHBOARD.read_text())
    return [
        target["expr"].replace("$__rate_interval", "1m").replace("$namespace", namespace)
        for panel in board["panels"]
        for target in panel["targets"]
    ]


def _count(server: prometheus.Server, kind: str, namespace: str) -> float:
    series = server.query(f'cairn_checkpoint_{kind}_seconds_sum{{namespace="{namespace}"}}')
    return float(series[0]["value"][1]) if series else -1.0


def _report(custom: client.CustomObjectsApi, namespace: str, checkpoints: dict[str, Any]) -> None:
    """A status patch as the writer on rank 0 sends it (its own field manager)."""
    custom.patch_namespaced_custom_object_status(
        GROUP,
        VERSION,
        namespace,
        PLURAL,
        "observed",
        {"status": {"checkpoints": checkpoints}},
        field_manager="test-writer",
    )


def test_prometheus_scrapes_the_operator(
    devcluster: DevclusterHandle,
    operator: OperatorProcess,
    namespace: str,
    server: prometheus.Server,
) -> None:
    custom = client.CustomObjectsApi(devcluster.api_client)
    job = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainingJob",
        "metadata": {"name": "observed"},
        "spec": {
            "suspend": True,
            "nodes": 1,
            "image": "cairn-trainer:dev",
            "command": ["python", "-c", "pass"],
            "checkpoint": {"intervalSteps": 5},
        },
    }
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job)
    # The operator's first sight of a job counts nothing: wait until it has seen it.
    kh.wait_for(
        lambda: server.query(f'cairn_trainingjob_phase{{namespace="{namespace}"}}'),
        timeout=WAIT,
        what="the job's phase series in Prometheus",
    )
    step5 = {"step": 5, "time": "2026-11-27T06:00:00Z", "writeSeconds": 1.5, "stallSeconds": 0.25}
    _report(custom, namespace, {"lastCommitted": step5})
    kh.wait_for(
        lambda: _count(server, "write", namespace) == 1.5,
        timeout=WAIT,
        what="step 5's write seconds in cairn_checkpoint_write_seconds",
    )
    assert _count(server, "stall", namespace) == 0.25
    step10 = {"step": 10, "time": "2026-11-27T06:00:10Z", "writeSeconds": 1.0}
    uploaded5 = {"step": 5, "time": "2026-11-27T06:00:04Z"}
    _report(custom, namespace, {"lastCommitted": step10, "lastUploaded": uploaded5})
    kh.wait_for(
        lambda: _count(server, "upload", namespace) == 4.0,
        timeout=WAIT,
        what="step 5's commit-to-upload seconds in cairn_checkpoint_upload_seconds",
    )
    assert _count(server, "write", namespace) == 2.5  # step 10 once, step 5 not again

    rules = kh.wait_for(
        lambda: (got := server.rules()) and all(r["lastEvaluation"] != NEVER for r in got) and got,
        timeout=WAIT,
        what="every rule evaluated",
    )
    assert {r["name"] for r in rules} >= {
        "CairnCheckpointStale",
        "CairnCheckpointUploadLagging",
        "CairnTrainingJobFailed",
        "CairnReconcileErrors",
    }
    assert [(r["name"], r["health"], r.get("lastError", "")) for r in rules] == [
        (r["name"], "ok", "") for r in rules
    ]
    for expr in dashboard_queries(namespace):
        kh.wait_for(functools.partial(server.query, expr), timeout=WAIT, what=f"series: {expr}")
    [leader] = server.query("cairn_leader")
    assert leader["value"][1] == "1"
    [info] = server.query("cairn_build_info")
    assert info["metric"]["version"]


def _metrics(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as got:
            return str(got.read().decode())
    except OSError:
        return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_standby_reports_no_jobs(
    devcluster: DevclusterHandle, namespace: str, tmp_path: pathlib.Path
) -> None:
    """A replica waiting for a Lease someone else holds: ``cairn_leader 0``, no job series."""
    coordination = client.CoordinationV1Api(devcluster.api_client)
    now = datetime.datetime.now(datetime.UTC)
    coordination.create_namespaced_lease(
        namespace,
        client.V1Lease(
            metadata=client.V1ObjectMeta(name="held"),
            spec=client.V1LeaseSpec(
                holder_identity="another-replica", lease_duration_seconds=60, renew_time=now
            ),
        ),
    )
    metrics_port, health_port = _free_port(), _free_port()
    env = dict(os.environ, KUBECONFIG=str(devcluster.kubeconfig))
    argv = [
        sys.executable,
        "-m",
        "cairn.operator",
        *("--namespace", namespace, "--leader-elect", "--lease-name", "held"),
        *("--lease-namespace", namespace, "--lease-duration", "60", "--renew-deadline", "30"),
        f"--liveness=http://127.0.0.1:{health_port}/healthz",
        f"--metrics-port={metrics_port}",
    ]
    with (tmp_path / "standby.log").open("wb") as log:
        standby = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        text = kh.wait_for(lambda: _metrics(metrics_port), timeout=WAIT, what="standby /metrics")
        assert "\ncairn_leader 0.0\n" in text
        assert "cairn_build_info{" in text
        assert "cairn_trainingjob" not in text  # no cairn_trainingjobs{phase} zeros, no job series
    finally:
        standby.kill()
        standby.wait(timeout=10)
