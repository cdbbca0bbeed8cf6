"""The node agent's pure parts: container plans, env, hosts files, pod status.

Covers (no cluster needed): `$(VAR)` expansion with `$$` escapes and unknown
references kept; env from fieldRef (name, namespace, uid, labels,
annotations, nodeName, serviceAccountName, podIP, hostIP), resourceFieldRef
with a divisor, secretKeyRef, configMapKeyRef (optional and missing),
envFrom with a prefix; the kubelet's KUBERNETES_SERVICE_* variables;
command + args with expansion and a missing command as a clear error;
volume mounts with subPath (escapes refused); headless-Service hosts
records and resolv.conf; pod phase, exit codes of signalled processes, and
condition transition times kept while a condition holds.
"""

from typing import Any

import pytest

from cairn.devcluster.agent import hosts, podspec, podstatus

POD: dict[str, Any] = {
    "metadata": {
        "name": "p",
        "namespace": "ns",
        "uid": "u-1",
        "labels": {"app": "web"},
        "annotations": {"note": "hi"},
    },
    "spec": {"nodeName": "node-0", "serviceAccountName": "sa"},
}


def _plan(container: dict[str, Any], **kwargs: Any) -> podspec.ContainerPlan:
    defaults: dict[str, Any] = {
        "pod": POD,
        "pod_ip": "10.244.1.3",
        "host_ip": "127.0.0.1",
        "hostname": "p",
        "secrets": {("ns", "creds"): {"password": "pw"}},
        "config_maps": {("ns", "cfg"): {"mode": "fast", "level": "3"}},
        "volume_dirs": {"data": "/state/data"},
        "base_env": {"PATH": "/bin"},
    }
    defaults.update(kwargs)
    return podspec.plan_container(container={"name": "c", **container}, **defaults)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$(A)-$(B)", "1-2"),
        ("$$(A)", "$(A)"),
        ("$(MISSING)", "$(MISSING)"),
        ("plain $A", "plain $A"),
    ],
)
def test_expand(text: str, expected: str) -> None:
    assert podspec.expand(text, {"A": "1", "B": "2"}) == expected


def test_env_sources_and_kubernetes_service() -> None:
    field = [
        ("NAME", "metadata.name", "p"),
        ("NS", "metadata.namespace", "ns"),
        ("UID", "metadata.uid", "u-1"),
        ("APP", "metadata.labels['app']", "web"),
        ("NOTE", "metadata.annotations['note']", "hi"),
        ("NODE", "spec.nodeName", "node-0"),
        ("SA", "spec.serviceAccountName", "sa"),
        ("IP", "status.podIP", "10.244.1.3"),
        ("HOST", "status.hostIP", "127.0.0.1"),
    ]
    env = [{"name": n, "valueFrom": {"fieldRef": {"fieldPath": f}}} for n, f, _ in field]
    env += [
        {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}},
        {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "mode"}}},
        {
            "name": "OPT",
            "valueFrom": {"configMapKeyRef": {"name": "nope", "key": "x", "optional": True}},
        },
        {
            "name": "MEM",
            "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}},
        },
        {"name": "ADDR", "value": "$(IP):29500"},
    ]
    plan = _plan(
        {
            "command": ["python", "-c"],
            "args": ["print('$(NAME)')", "$(ADDR)"],
            "env": env,
            "envFrom": [{"prefix": "CFG_", "configMapRef": {"name": "cfg"}}],
            "resources": {"limits": {"memory": "1Gi"}},
        }
    )
    for name, _, value in field:
        assert plan.env[name] == value
    assert plan.env["PW"] == "pw"
    assert plan.env["MODE"] == "fast"
    assert "OPT" not in plan.env
    assert plan.env["MEM"] == "1024"
    assert plan.env["CFG_level"] == "3"
    assert plan.env["KUBERNETES_SERVICE_HOST"] == "10.244.0.1"
    assert plan.env["KUBERNETES_SERVICE_PORT"] == "6443"
    assert plan.env["PATH"] == "/bin"
    assert plan.argv == ("python", "-c", "print('p')", "10.244.1.3:29500")


@pytest.mark.parametrize(
    ("container", "reason"),
    [
        ({"args": ["x"]}, "CreateContainerError"),
        (
            {
                "command": ["x"],
                "env": [{"name": "P", "valueFrom": {"secretKeyRef": {"name": "gone", "key": "k"}}}],
            },
            "CreateContainerConfigError",
        ),
        (
            {
                "command": ["x"],
                "volumeMounts": [{"name": "data", "mountPath": "/d", "subPath": "../x"}],
            },
            "CreateContainerConfigError",
        ),
        (
            {"command": ["x"], "volumeMounts": [{"name": "nope", "mountPath": "/d"}]},
            "CreateContainerConfigError",
        ),
    ],
)
def test_unrunnable_containers_name_a_reason(container: dict[str, Any], reason: str) -> None:
    with pytest.raises(podspec.SpecError) as info:
        _plan(container)
    assert info.value.reason == reason


def test_mounts_and_working_dir() -> None:
    plan = _plan(
        {
            "command": ["true"],
            "workingDir": "/work",
            "volumeMounts": [
                {"name": "data", "mountPath": "/data"},
                {"name": "data", "mountPath": "/sub", "subPath": "a/b", "readOnly": True},
            ],
        }
    )
    assert plan.mounts == (
        podspec.Mount(source="/state/data", target="/data", read_only=False),
        podspec.Mount(source="/state/data/a/b", target="/sub", read_only=True),
    )
    assert plan.working_dir == "/work"


def test_hosts_records_only_for_headless_services() -> None:
    worker = hosts.PodAddress(
        namespace="ns", name="w-0", hostname="w-0", subdomain="ring", ip="10.244.1.2"
    )
    lonely = hosts.PodAddress(
        namespace="ns", name="x", hostname="x", subdomain="none", ip="10.244.1.3"
    )
    lines = hosts.records(pods=[worker, lonely], services={("ns", "ring")})
    assert lines == ["10.244.1.2 w-0.ring.ns.svc.cluster.local w-0.ring.ns.svc w-0.ring.ns"]
    text = hosts.hosts_file(own=lonely, cluster_records=lines)
    assert "127.0.0.1 localhost" in text
    assert "10.244.1.3 x.none.ns.svc.cluster.local x" in text
    assert lines[0] in text
    assert hosts.resolv_conf("ns").startswith(
        "search ns.svc.cluster.local svc.cluster.local cluster.local"
    )


def _container(*, init: bool = False, **state: Any) -> podstatus.Container:
    container = podstatus.Container(spec={"name": "c"}, init=init)
    container.state = state or container.state
    return container


def test_phase() -> None:
    done_ok = _container(terminated={"exitCode": 0})
    done_ok.done = True
    done_bad = _container(terminated={"exitCode": 2})
    done_bad.done = True
    running = _container(running={"startedAt": "t"})
    assert podstatus.phase([_container()]) == "Pending"
    assert podstatus.phase([running, done_ok]) == "Running"
    assert podstatus.phase([done_ok]) == "Succeeded"
    assert podstatus.phase([done_ok, done_bad]) == "Failed"
    backing_off = _container(waiting={"reason": "CrashLoopBackOff"})
    backing_off.restart_count = 1
    assert podstatus.phase([backing_off]) == "Running"
    assert podstatus.exit_code(-9) == 137
    assert podstatus.exit_code(3) == 3


def test_status_body_and_transition_times() -> None:
    ready = podstatus.status_body(
        phase="Running",
        containers=[{"name": "c", "ready": True}],
        inits=[],
        pod_ip="10.244.1.2",
        start_time="t0",
    )
    conditions = {c["type"]: c["status"] for c in ready["conditions"]}
    assert conditions == {
        "PodReadyToStartContainers": "True",
        "Initialized": "True",
        "ContainersReady": "True",
        "Ready": "True",
        "PodScheduled": "True",
    }
    assert ready["podIP"] == "10.244.1.2"
    assert ready["hostIP"] == "127.0.0.1"
    first = podstatus.with_transition_times(status=ready, previous=None, at="t1")
    done = podstatus.status_body(
        phase="Succeeded",
        containers=[{"name": "c", "ready": False}],
        inits=[],
        pod_ip="10.244.1.2",
        start_time="t0",
    )
    second = podstatus.with_transition_times(status=done, previous=first, at="t2")
    times = {c["type"]: c["lastTransitionTime"] for c in second["conditions"]}
    assert times["PodScheduled"] == "t1"
    assert times["Ready"] == "t2"
