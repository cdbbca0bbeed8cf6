"""A real job's NetworkPolicy, enforced: its rendezvous port admits only its own pods.

The shared operator makes the job, its pods and its `<job>-ingress` policy;
the job's pods and an outside pod run on a private agent's tainted node
(`tests/integration/devcluster/private_agent.py`, this tree's agent code,
which enforces NetworkPolicy ingress), so the check holds whatever agent
version the shared devcluster runs. Rank 0 listens on the job's
`MASTER_PORT` (29500, where torchrun's rendezvous store listens). Covers:
rank 1 (a pod of the job) connects; a pod outside the job, same namespace,
connecting to rank 0's address is dropped (2 s connect timeout each) and
never gets through.
"""

import os
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes.client.rest import ApiException

from tests.integration.devcluster import kube_helpers as kh
from tests.integration.devcluster import private_agent as private
from tests.integration.operator.conftest import GROUP, PLURAL, VERSION, WAIT, Kube, job_body

pytestmark = pytest.mark.cluster

JOB = "fenced-rdzv"
NODE = f"netpol-e2e-{os.getpid()}"
TAINT = "cairn.dev/netpol-test"
RANKS = """
import os, socket, time
port = int(os.environ['MASTER_PORT'])
if os.environ['RANK'] == '0':
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(('0.0.0.0', port))
    srv.listen()
    while True:
        conn, _ = srv.accept()
        conn.sendall(b'hello')
        conn.close()
while True:
    try:
        conn = socket.create_connection((os.environ['MASTER_ADDR'], port), timeout=2)
        print('result ' + conn.recv(16).decode(), flush=True)
        break
    except OSError as exc:
        print('result ' + type(exc).__name__, flush=True)
        time.sleep(0.3)
time.sleep(600)
"""
OUTSIDER = """
import os, socket, time
while True:
    try:
        conn = socket.create_connection((os.environ['TARGET'], 29500), timeout=2)
        print('result ' + conn.recv(16).decode(), flush=True)
        conn.close()
    except OSError as exc:
        print('result ' + type(exc).__name__, flush=True)
    time.sleep(0.3)
"""


@pytest.fixture
def private_node(devcluster: Any, tmp_path: pathlib.Path) -> Iterator[str]:
    node = f"{NODE}:label.{TAINT}={NODE},taint.{TAINT}=1:NoSchedule"
    with private.running(devcluster=devcluster, node=node, log_path=tmp_path / "agent.log") as name:
        yield name


def _results(kube: Kube, pod: Any) -> list[str]:
    container = pod.spec.containers[0].name
    try:
        text = kh.pod_log(kube.core, pod.metadata.name, kube.namespace, container=container)
    except ApiException:
        return []
    return [line.split(" ", 1)[1] for line in text.splitlines() if line.startswith("result ")]


def _outsider(target: str, node: str) -> dict[str, Any]:
    pod = kh.python_pod(
        "outsider",
        OUTSIDER,
        nodeName=node,
        container={"env": [{"name": "TARGET", "value": target}]},
    )
    pod["spec"]["tolerations"] = [{"key": TAINT, "operator": "Exists"}]
    pod["spec"]["terminationGracePeriodSeconds"] = 1
    return pod


def _remove_all(kube: Kube) -> None:
    """Before the private agent stops, so no pod waits for pod GC."""
    try:
        kube.custom.delete_namespaced_custom_object(GROUP, VERSION, kube.namespace, PLURAL, JOB)
    except ApiException as exc:
        if exc.status != 404:
            raise
    kube.core.delete_collection_namespaced_pod(kube.namespace, grace_period_seconds=0)
    kh.wait_for(
        lambda: not kube.core.list_namespaced_pod(kube.namespace).items,
        timeout=WAIT,
        what="the job's and the outsider's pods to be deleted",
    )


def test_rendezvous_port_admits_the_job_and_drops_an_outsider(
    kube: Kube, private_node: str
) -> None:
    template = {
        "nodeSelector": {TAINT: private_node},
        "tolerations": [{"key": TAINT, "operator": "Exists"}],
    }
    try:
        kube.create(job_body(JOB, script=RANKS, nodes=2, template=template))
        pods = kube.wait_pods_running(JOB, attempt=1, count=2)
        rank0, rank1 = sorted(pods, key=lambda p: p.metadata.labels["cairn.dev/rank"])
        assert rank0.spec.node_name == rank1.spec.node_name == private_node
        kh.wait_for(
            lambda: "hello" in _results(kube, rank1),
            timeout=WAIT,
            what="rank 1 to reach rank 0's rendezvous port",
        )
        outsider = kube.core.create_namespaced_pod(
            kube.namespace, _outsider(rank0.status.pod_ip, private_node)
        )
        kh.wait_for(
            lambda: "TimeoutError" in _results(kube, outsider),
            timeout=WAIT,
            what="an outsider's connect to rank 0 to be dropped",
        )
        assert "hello" not in _results(kube, outsider)
    finally:
        _remove_all(kube)
