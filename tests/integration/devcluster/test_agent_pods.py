"""Pods run on the node agent the way a kubelet runs them.

Covers: env from fieldRef and secretKeyRef, an emptyDir, a PVC (dynamic
provisioning through the default StorageClass) and the projected
ServiceAccount token all work in a pod that runs to Succeeded, with its exit
code and logs visible through the API; a pod exiting 1 with
restartPolicy OnFailure is restarted; deleting a running pod delivers
SIGTERM, waits the grace period, then SIGKILL; a child that ignores SIGTERM
dies with its container's main process, whether the pod completed or was
deleted (a warm launcher's fork server used to outlive its pod); the scheduler places by
extended resources and nodeSelector (an unsatisfiable GPU request stays
Pending).
"""

import base64
import functools
import json
import os
import pathlib
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from tests.integration.devcluster import kube_helpers as kh

pytestmark = pytest.mark.cluster


@pytest.fixture
def namespace(devcluster: Any) -> Iterator[str]:
    yield from kh.temp_namespace(devcluster.core, "agent")


CHECK_EVERYTHING = """
import json, os, pathlib, sys
token = pathlib.Path('/var/run/secrets/kubernetes.io/serviceaccount/token').read_text()
payload = token.split('.')[1]
claims = json.loads(__import__('base64').urlsafe_b64decode(payload + '=' * (-len(payload) % 4)))
pathlib.Path('/scratch/x').write_text('scratch ok')
pathlib.Path('/data/from-pod').write_text(os.environ['POD_NAME'])
print(json.dumps({
    'pod': os.environ['POD_NAME'], 'node': os.environ['NODE_NAME'], 'ip': os.environ['POD_IP'],
    'password': os.environ['PASSWORD'], 'label': os.environ['APP'],
    'scratch': pathlib.Path('/scratch/x').read_text(),
    'audience': claims['aud'], 'sub': claims['sub'],
    'namespace_file': pathlib.Path('/var/run/secrets/kubernetes.io/serviceaccount/namespace').read_text(),
    'ca': pathlib.Path('/var/run/secrets/kubernetes.io/serviceaccount/ca.crt').read_text().startswith('-----BEGIN'),
    'custom_token_aud': json.loads(__import__('base64').urlsafe_b64decode(
        (p := pathlib.Path('/tokens/vault').read_text().split('.')[1]) + '=' * (-len(p) % 4)))['aud'],
}), flush=True)
sys.exit(3 if os.environ.get('FAIL') else 0)
"""


def test_env_volumes_token_and_logs(devcluster: Any, namespace: str) -> None:
    core = devcluster.core
    core.create_namespaced_secret(
        namespace,
        client.V1Secret(
            metadata=client.V1ObjectMeta(name="creds"),
            data={"password": base64.b64encode(b"s3cr3t").decode()},
        ),
    )
    core.create_namespaced_persistent_volume_claim(
        namespace,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "data"},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    )
    pod = kh.python_pod(
        "everything",
        CHECK_EVERYTHING,
        container={
            "env": [
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
                {
                    "name": "PASSWORD",
                    "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}},
                },
            ],
            "volumeMounts": [
                {"name": "scratch", "mountPath": "/scratch"},
                {"name": "data", "mountPath": "/data"},
                {"name": "vault", "mountPath": "/tokens", "readOnly": True},
            ],
        },
        volumes=[
            {"name": "scratch", "emptyDir": {}},
            {"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
            {
                "name": "vault",
                "projected": {
                    "sources": [
                        {
                            "serviceAccountToken": {
                                "audience": "vault",
                                "expirationSeconds": 3600,
                                "path": "vault",
                            }
                        }
                    ]
                },
            },
        ],
    )
    pod["metadata"]["labels"] = {"app": "everything"}
    core.create_namespaced_pod(namespace, pod)
    kh.wait_for(
        lambda: kh.pod_phase(core, "everything", namespace) == "Succeeded",
        timeout=90,
        what="the pod to succeed",
    )
    got = core.read_namespaced_pod("everything", namespace)
    terminated = got.status.container_statuses[0].state.terminated
    assert terminated.exit_code == 0
    assert terminated.reason == "Completed"
    report = json.loads(kh.pod_log(core, "everything", namespace).strip())
    assert report["pod"] == "everything"
    assert report["node"] == got.spec.node_name
    assert report["ip"] == got.status.pod_ip
    assert report["password"] == "s3cr3t"
    assert report["label"] == "everything"
    assert report["scratch"] == "scratch ok"
    assert report["sub"] == f"system:serviceaccount:{namespace}:default"
    assert report["namespace_file"] == namespace
    assert report["ca"] is True
    assert report["custom_token_aud"] == ["vault"]
    pvc = core.read_namespaced_persistent_volume_claim("data", namespace)
    assert pvc.status.phase == "Bound"
    pv = core.read_persistent_volume(pvc.spec.volume_name)
    from pathlib import Path

    assert (Path(pv.spec.host_path.path) / "from-pod").read_text() == "everything"


def test_exit_code_visible_and_on_failure_restarts(devcluster: Any, namespace: str) -> None:
    core = devcluster.core
    core.create_namespaced_pod(
        namespace, kh.python_pod("fails", "import sys; print('bye'); sys.exit(7)")
    )
    kh.wait_for(
        lambda: kh.pod_phase(core, "fails", namespace) == "Failed", timeout=60, what="Failed"
    )
    state = core.read_namespaced_pod("fails", namespace).status.container_statuses[0].state
    assert state.terminated.exit_code == 7
    assert state.terminated.reason == "Error"

    core.create_namespaced_pod(
        namespace,
        kh.python_pod("flaky", "import sys; sys.exit(1)", restart_policy="OnFailure"),
    )

    def restarted() -> bool:
        statuses = core.read_namespaced_pod("flaky", namespace).status.container_statuses
        return bool(statuses) and statuses[0].restart_count >= 1

    kh.wait_for(restarted, timeout=90, what="an OnFailure restart")
    status = core.read_namespaced_pod("flaky", namespace).status
    assert status.phase in ("Running", "Pending")
    assert status.container_statuses[0].last_state.terminated.exit_code == 1


TERM_RECORDER = """
import signal, time, pathlib
path = pathlib.Path('/out/events')
def on_term(*_):
    path.write_text('TERM at %f\\n' % time.time())
signal.signal(signal.SIGTERM, on_term)
print('ready', flush=True)
while True:
    time.sleep(0.1)
"""


def test_delete_sends_sigterm_then_sigkill(devcluster: Any, namespace: str, tmp_path: Any) -> None:
    core = devcluster.core
    out = tmp_path / "out"
    out.mkdir()
    pod = kh.python_pod(
        "stubborn",
        TERM_RECORDER,
        grace=3,
        container={"volumeMounts": [{"name": "out", "mountPath": "/out"}]},
        volumes=[{"name": "out", "hostPath": {"path": str(out)}}],
    )
    core.create_namespaced_pod(namespace, pod)
    kh.wait_for(
        lambda: (
            "ready" in kh.pod_log(core, "stubborn", namespace)
            if kh.pod_phase(core, "stubborn", namespace) == "Running"
            else False
        ),
        timeout=60,
        what="the pod to run",
    )
    deleted_at = time.time()
    core.delete_namespaced_pod("stubborn", namespace)
    kh.wait_for(
        lambda: kh.pod_phase(core, "stubborn", namespace) is None,
        timeout=60,
        what="the pod object to be removed",
    )
    gone_at = time.time()
    events = (out / "events").read_text()
    assert events.startswith("TERM at")
    term_at = float(events.split()[-1])
    assert term_at >= deleted_at - 1
    # It ignored SIGTERM, so only SIGKILL after the 3 s grace period ended it.
    assert gone_at - term_at >= 2.5


ORPHAN_MAKER = """
import os, pathlib, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, '-c',
    'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])
pathlib.Path('/out/%s' % os.environ['POD_NAME']).write_text(str(child.pid))
print('ready', flush=True)
if os.environ.get('WAIT'):
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # the parent obeys, the child not
    time.sleep(600)
"""


def _gone(pid: int) -> bool:
    return not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_containers_leftover_processes_die_with_it(
    devcluster: Any, namespace: str, tmp_path: Any
) -> None:
    core = devcluster.core
    out = tmp_path / "out"
    out.mkdir()
    mounts = {"volumeMounts": [{"name": "out", "mountPath": "/out"}]}
    volumes = [{"name": "out", "hostPath": {"path": str(out)}}]
    env = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    for name, wait in (("completes", ""), ("deleted", "1")):
        container = {**mounts, "env": [*env, {"name": "WAIT", "value": wait}]}
        pod = kh.python_pod(name, ORPHAN_MAKER, grace=3, container=container, volumes=volumes)
        core.create_namespaced_pod(namespace, pod)
    kh.wait_for(
        lambda: kh.pod_phase(core, "completes", namespace) == "Succeeded",
        timeout=60,
        what="the completing pod to succeed",
    )
    kh.wait_for(
        lambda: "ready" in kh.pod_log(core, "deleted", namespace),
        timeout=60,
        what="the other pod to run",
    )
    core.delete_namespaced_pod("deleted", namespace)
    kh.wait_for(
        lambda: kh.pod_phase(core, "deleted", namespace) is None,
        timeout=60,
        what="the deleted pod to be removed",
    )
    children = [int((out / name).read_text()) for name in ("completes", "deleted")]
    try:
        for name, child in zip(("completes", "deleted"), children, strict=True):
            kh.wait_for(
                functools.partial(_gone, child), timeout=10, what=f"{name}'s child to be gone"
            )
    finally:  # a failure here must not leave the children behind
        for child in children:
            if _alive(child):
                os.kill(child, signal.SIGKILL)


def test_scheduler_honours_extended_resources(devcluster: Any, namespace: str) -> None:
    core = devcluster.core
    gpu = kh.python_pod(
        "one-gpu",
        "print('gpu')",
        container={"resources": {"limits": {"nvidia.com/gpu": "1"}}},
    )
    core.create_namespaced_pod(namespace, gpu)
    too_many = kh.python_pod(
        "nine-gpus",
        "print('never')",
        container={"resources": {"limits": {"nvidia.com/gpu": "9"}}},
    )
    core.create_namespaced_pod(namespace, too_many)
    selected = kh.python_pod(
        "on-node-1", "print('here')", nodeSelector={"kubernetes.io/hostname": "devcluster-node-1"}
    )
    core.create_namespaced_pod(namespace, selected)
    kh.wait_for(
        lambda: kh.pod_phase(core, "one-gpu", namespace) == "Succeeded", timeout=60, what="gpu pod"
    )
    kh.wait_for(
        lambda: kh.pod_phase(core, "on-node-1", namespace) == "Succeeded",
        timeout=60,
        what="selected pod",
    )
    assert core.read_namespaced_pod("one-gpu", namespace).spec.node_name == "devcluster-node-0"
    assert core.read_namespaced_pod("on-node-1", namespace).spec.node_name == "devcluster-node-1"

    def unschedulable() -> bool:
        conditions = core.read_namespaced_pod("nine-gpus", namespace).status.conditions or []
        return any(c.type == "PodScheduled" and c.reason == "Unschedulable" for c in conditions)

    kh.wait_for(unschedulable, timeout=60, what="the scheduler to report Unschedulable")
    assert kh.pod_phase(core, "nine-gpus", namespace) == "Pending"
