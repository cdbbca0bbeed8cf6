"""A private node that enforces NetworkPolicy, and pods outside a job probing it (not tests).

For `tests/e2e/test_adversary.py`'s network cases. The job's pods and the
outsider run on a private agent's tainted node
(`tests/integration/devcluster/private_agent.py`, this tree's agent code,
which enforces NetworkPolicy ingress), so a check holds whatever agent
version the shared devcluster runs. The outsider is a plain pod of the job's
namespace without the job's labels: every 0.3 s it connects to each of the
given ports (2 s connect timeout each, all ports at once) and logs
``result <port> <outcome>``, ``connected`` or the error's class name
(``TimeoutError``: dropped by the policy). The Ray decoy carries the job's
label (so the policy admits it) but not its token, and tries the head's GCS
once: ``decoy tcp <outcome>``, then ``decoy gcs <outcome>``.

The jobs' scripts: `RENDEZVOUS_RANKS` (rank 0 listens on ``MASTER_PORT`` and
answers ``hello``; rank 1 connects, logging ``result <outcome>``) and
`RAY_DRIVER` (a ``runtime: ray`` job's driver on the head: logs
``head-ports <json>``, every TCP port the head pod listens on outside
loopback, then ``worker-reached <json>``, each port's outcome for a task
pinned to the worker pod connecting to the head).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Iterator
from typing import Any

from kubernetes.client.rest import ApiException

from tests.integration.devcluster import kube_helpers as kh
from tests.integration.devcluster import private_agent as private
from tests.integration.operator.conftest import GROUP, LABEL_JOB, PLURAL, VERSION, WAIT, Kube

NODE = f"netpol-e2e-{os.getpid()}"
TAINT = "cairn.dev/netpol-test"
RENDEZVOUS_RANKS = """
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
RAY_DRIVER = """
import json, os, socket, time
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

def listening():
    # TCP LISTEN sockets of this pod's network namespace, loopback left out
    # (IPv4 rows are little-endian: 127.x.y.z ends in 7F).
    ports = set()
    for table in ('/proc/net/tcp', '/proc/net/tcp6'):
        with open(table) as rows:
            for row in list(rows)[1:]:
                local, state = row.split()[1], row.split()[3]
                address, port = local.split(':')
                if state == '0A' and address[-2:] != '7F' and address != '0' * 24 + '01000000':
                    ports.add(int(port, 16))
    return sorted(ports)

@ray.remote(num_cpus=0)
def reach(host, ports):
    outcome = {}
    for port in ports:
        try:
            socket.create_connection((host, port), timeout=5).close()
            outcome[port] = 'connected'
        except OSError as exc:
            outcome[port] = type(exc).__name__
    return outcome

ray.init(log_to_driver=False)
head = os.environ['CAIRN_POD_IP']
ports = listening()
print('head-ports ' + json.dumps(ports), flush=True)
worker = next(n['NodeID'] for n in ray.nodes() if n['Alive'] and n['NodeManagerAddress'] != head)
on_worker = NodeAffinitySchedulingStrategy(worker, soft=False)
inside = ray.get(reach.options(scheduling_strategy=on_worker).remote(head, ports), timeout=120)
print('worker-reached ' + json.dumps(inside), flush=True)
time.sleep(600)
"""
OUTSIDER = """
import concurrent.futures, os, socket, time
ports = [int(p) for p in os.environ['PORTS'].split(',')]
def probe(port):
    try:
        with socket.create_connection((os.environ['TARGET'], port), timeout=2):
            return 'connected'
    except OSError as exc:
        return type(exc).__name__
with concurrent.futures.ThreadPoolExecutor(len(ports)) as pool:
    while True:
        for port, outcome in zip(ports, pool.map(probe, ports)):
            print(f'result {port} {outcome}', flush=True)
        time.sleep(0.3)
"""

RAY_DECOY = """
import os, socket
target, port = os.environ['TARGET'], int(os.environ['PORT'])
try:
    socket.create_connection((target, port), timeout=5).close()
    print('decoy tcp connected', flush=True)
except OSError as exc:
    print('decoy tcp ' + type(exc).__name__, flush=True)
try:
    from ray._raylet import GcsClient
    nodes = GcsClient(address=f'{target}:{port}', cluster_id=None).get_all_node_info(timeout=10)
    print(f'decoy gcs {len(nodes)} nodes', flush=True)
except Exception as exc:
    print(f'decoy gcs {type(exc).__name__}: {exc}', flush=True)
"""


@contextlib.contextmanager
def private_node(devcluster: Any, log_path: pathlib.Path) -> Iterator[str]:
    """The private agent's node (labelled and tainted `TAINT`), for the block."""
    node = f"{NODE}:label.{TAINT}={NODE},taint.{TAINT}=1:NoSchedule"
    with private.running(devcluster=devcluster, node=node, log_path=log_path) as name:
        yield name


def on_node(node: str) -> dict[str, Any]:
    """A TrainingJob's `template` that puts its pods on the private node."""
    return {"nodeSelector": {TAINT: node}, "tolerations": [{"key": TAINT, "operator": "Exists"}]}


def logged(kube: Kube, pod: Any, prefix: str) -> list[str]:
    """What the pod's first container logged on lines `<prefix> …` (none yet: [])."""
    container = pod.spec.containers[0].name
    try:
        text = kh.pod_log(kube.core, pod.metadata.name, kube.namespace, container=container)
    except ApiException:
        return []
    start = f"{prefix} "
    return [line[len(start) :] for line in text.splitlines() if line.startswith(start)]


def wait_logged(kube: Kube, pod: Any, prefix: str, *, timeout: float, what: str) -> str:
    """The first `<prefix> …` line's rest; on timeout, fails with the pod's log tail."""
    try:
        found: list[str] = kh.wait_for(
            lambda: logged(kube, pod, prefix), timeout=timeout, what=what
        )
    except AssertionError as exc:
        try:
            tail = kh.pod_log(kube.core, pod.metadata.name, kube.namespace)[-3000:]
        except ApiException as log_error:
            tail = f"(no log: {log_error.status} {log_error.reason})"
        raise AssertionError(f"{exc}; {pod.metadata.name}'s log ends:\n{tail}") from None
    return found[0]


def outcomes(kube: Kube, outsider: Any) -> dict[int, set[str]]:
    """Each probed port's outcomes so far."""
    found: dict[int, set[str]] = {}
    for line in logged(kube, outsider, "result"):
        port, _, outcome = line.partition(" ")
        found.setdefault(int(port), set()).add(outcome)
    return found


def start_outsider(kube: Kube, *, target: str, ports: list[int], node: str) -> Any:
    """The outsider pod (no label of the job), probing `target`'s `ports`."""
    env = [
        {"name": "TARGET", "value": target},
        {"name": "PORTS", "value": ",".join(map(str, ports))},
    ]
    pod = kh.python_pod("outsider", OUTSIDER, nodeName=node, grace=1, container={"env": env})
    pod["spec"]["tolerations"] = [{"key": TAINT, "operator": "Exists"}]
    return kube.core.create_namespaced_pod(kube.namespace, pod)


def start_ray_decoy(kube: Kube, *, job: str, target: str, port: int, node: str) -> Any:
    """A pod with the job's label, no token and Ray's auth off, connecting to `target`'s
    GCS `port` once (TCP, then a GCS client); it logs ``decoy tcp …`` and ``decoy gcs …``."""
    env = [
        {"name": "TARGET", "value": target},
        {"name": "PORT", "value": str(port)},
        {"name": "RAY_AUTH_MODE", "value": "disabled"},
    ]
    pod = kh.python_pod("decoy", RAY_DECOY, nodeName=node, grace=1, container={"env": env})
    pod["metadata"]["labels"] = {LABEL_JOB: job}
    pod["spec"]["tolerations"] = [{"key": TAINT, "operator": "Exists"}]
    return kube.core.create_namespaced_pod(kube.namespace, pod)


def wait_dropped(kube: Kube, outsider: Any, ports: list[int]) -> dict[int, set[str]]:
    """Until every port timed out for the outsider at least once; never connected."""
    seen: dict[int, set[str]] = kh.wait_for(
        lambda: (
            (o := outcomes(kube, outsider))
            and all("TimeoutError" in o.get(port, ()) for port in ports)
            and o
        ),
        timeout=WAIT,
        what=f"the outsider's connects to {ports} to be dropped",
    )
    assert not [port for port, seen_here in seen.items() if "connected" in seen_here], seen
    return seen


def remove_all(kube: Kube, job: str) -> None:
    """Before the private agent stops, so no pod waits for pod GC. The job's
    deletion lets its pods stop in their grace (a Ray launcher stops Ray by
    PID); the outsider and the decoy go at once."""
    try:
        kube.custom.delete_namespaced_custom_object(GROUP, VERSION, kube.namespace, PLURAL, job)
    except ApiException as exc:
        if exc.status != 404:
            raise
    for stranger in ("outsider", "decoy"):
        try:
            kube.core.delete_namespaced_pod(stranger, kube.namespace, grace_period_seconds=0)
        except ApiException as exc:
            if exc.status != 404:
                raise
    kh.wait_for(
        lambda: not kube.core.list_namespaced_pod(kube.namespace).items,
        timeout=WAIT,
        what="the job's and the outsider's pods to be deleted",
    )
