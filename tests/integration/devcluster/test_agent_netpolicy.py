"""NetworkPolicy enforcement by the node agent, through the real API server.

A private agent (`private_agent`, this tree's agent code, its own tainted
node beside the shared agent's) runs three pods: A serves TCP 29500 and,
with B, carries the job label; C does not. A NetworkPolicy admits ingress
to the job's pods only from pods with the job label. Covers: B connects to
A; C's connects to A are dropped (each bounded by a 2 s connect timeout)
and none succeeds while the policy exists; deleting the policy lets C
connect. Every wait has a deadline.
"""

import os
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.integration.devcluster import kube_helpers as kh
from tests.integration.devcluster import private_agent as private

pytestmark = pytest.mark.cluster

NODE = f"netpol-{os.getpid()}"
TAINT = "cairn.dev/netpol-test"
JOB = {"cairn.dev/job-name": "np-job"}
SERVER = """
import socket
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(('0.0.0.0', 29500))
srv.listen()
while True:
    conn, _ = srv.accept()
    conn.sendall(b'hello')
    conn.close()
"""
PROBE = """
import os, socket, time
target = 'server.ring.' + os.environ['NS'] + '.svc.cluster.local'
while True:
    try:
        conn = socket.create_connection((target, 29500), timeout=2)
        print('result ' + conn.recv(16).decode(), flush=True)
        conn.close()
    except OSError as exc:
        print('result ' + type(exc).__name__, flush=True)
    time.sleep(0.3)
"""


@pytest.fixture
def private_agent(devcluster: Any, tmp_path: pathlib.Path) -> Iterator[str]:
    node = f"{NODE}:taint.{TAINT}=1:NoSchedule"
    with private.running(devcluster=devcluster, node=node, log_path=tmp_path / "agent.log") as name:
        yield name


@pytest.fixture
def namespace(devcluster: Any, private_agent: str) -> Iterator[str]:
    """Its pods are gone before the private agent stops (else they wait for pod GC)."""
    gen = kh.temp_namespace(devcluster.core, "np")
    name = next(gen)
    yield name
    devcluster.core.delete_collection_namespaced_pod(name, grace_period_seconds=0)
    kh.wait_for(
        lambda: not devcluster.core.list_namespaced_pod(name).items,
        timeout=60,
        what=f"the pods of {name} to be deleted by the private agent",
    )
    next(gen, None)


def _pod(name: str, code: str, *, node: str, labels: dict[str, str]) -> dict[str, Any]:
    env = [{"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
    pod = kh.python_pod(
        name, code, hostname=name, subdomain="ring", nodeName=node, container={"env": env}, grace=1
    )
    pod["spec"]["tolerations"] = [{"key": TAINT, "operator": "Exists"}]
    pod["metadata"]["labels"] = {"pair": "ring", **labels}
    return pod


def _policy() -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "np-job"},
        "spec": {
            "podSelector": {"matchLabels": JOB},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": JOB}}]}],
        },
    }


def _results(core: Any, name: str, namespace: str) -> list[str]:
    try:
        text = kh.pod_log(core, name, namespace)
    except ApiException:  # not started yet: no log
        return []
    return [line.split(" ", 1)[1] for line in text.splitlines() if line.startswith("result ")]


def test_policy_admits_job_pod_drops_outsider_until_deleted(
    devcluster: Any, private_agent: str, namespace: str
) -> None:
    core = devcluster.core
    networking = client.NetworkingV1Api(devcluster.api_client)
    networking.create_namespaced_network_policy(namespace, _policy())
    core.create_namespaced_service(
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "ring"},
            "spec": {"clusterIP": "None", "selector": {"pair": "ring"}, "ports": [{"port": 29500}]},
        },
    )
    for name, code, labels in (
        ("server", SERVER, JOB),
        ("member", PROBE, JOB),
        ("outsider", PROBE, {}),
    ):
        core.create_namespaced_pod(namespace, _pod(name, code, node=private_agent, labels=labels))

    kh.wait_for(
        lambda: "hello" in _results(core, "member", namespace),
        timeout=90,
        what="the job's pod to reach the server",
    )
    seen = len(_results(core, "outsider", namespace))
    kh.wait_for(
        lambda: "TimeoutError" in _results(core, "outsider", namespace)[seen:],
        timeout=30,
        what="an outsider connect attempt after the server listens",
    )
    assert "hello" not in _results(core, "outsider", namespace)

    networking.delete_namespaced_network_policy("np-job", namespace)
    kh.wait_for(
        lambda: "hello" in _results(core, "outsider", namespace),
        timeout=30,
        what="the outsider to connect once the policy is gone",
    )
