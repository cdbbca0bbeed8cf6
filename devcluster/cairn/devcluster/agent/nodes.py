"""Registers the agent's Nodes and keeps them Ready with Leases.

Each `--node NAME:cpu=4,memory=16Gi,nvidia.com/gpu=2` becomes a Node with
that capacity (and `pods`), labels from `label.<k>=<v>` items, taints from
`taint.<k>=<v>:<Effect>` items (`taint.<k>:<Effect>` without a value),
address 127.0.0.1, its own kubelet port, and a
Lease in `kube-node-lease` renewed every 10 s; the Ready condition's
heartbeat is refreshed every 30 s, as a kubelet with node leases does.
"""

import dataclasses
import datetime
import platform
import threading
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from cairn.devcluster import build

LEASE_SECONDS = 40
RENEW_SECONDS = 10.0
STATUS_SECONDS = 30.0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class NodeSpec:
    name: str
    capacity: dict[str, str]
    kubelet_port: int
    labels: dict[str, str]
    taints: tuple[tuple[str, str, str], ...] = ()
    """(key, value, effect) for each taint; value may be empty."""


def parse_node(text: str, *, kubelet_port: int) -> NodeSpec:
    """Pure: `name:key=value,...`; `label.<k>=<v>` adds a label, `taint.<k>=<v>:<E>` a taint."""
    name, _, rest = text.partition(":")
    capacity = {"cpu": "4", "memory": "16Gi", "pods": "110", "ephemeral-storage": "100Gi"}
    labels: dict[str, str] = {}
    taints: list[tuple[str, str, str]] = []
    for item in filter(None, rest.split(",")):
        if item.startswith("taint."):
            body, _, effect = item[len("taint.") :].rpartition(":")
            key, _, value = body.partition("=")
            taints.append((key, value, effect))
            continue
        key, _, value = item.partition("=")
        if key.startswith("label."):
            labels[key[len("label.") :]] = value
        else:
            capacity[key] = value
    return NodeSpec(
        name=name,
        capacity=capacity,
        kubelet_port=kubelet_port,
        labels=labels,
        taints=tuple(taints),
    )


def node_taints(spec: NodeSpec) -> list[dict[str, str]]:
    """Pure: the Node's `spec.taints`."""
    return [
        {"key": key, "effect": effect, **({"value": value} if value else {})}
        for key, value, effect in spec.taints
    ]


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _ready_conditions(now: str) -> list[dict[str, str]]:
    def cond(kind: str, status: str, reason: str) -> dict[str, str]:
        return {
            "type": kind,
            "status": status,
            "reason": reason,
            "message": reason,
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }

    return [
        cond("Ready", "True", "KubeletReady"),
        cond("MemoryPressure", "False", "KubeletHasSufficientMemory"),
        cond("DiskPressure", "False", "KubeletHasNoDiskPressure"),
        cond("PIDPressure", "False", "KubeletHasSufficientPID"),
    ]


def node_status(spec: NodeSpec, *, now: str) -> dict[str, Any]:
    return {
        "capacity": spec.capacity,
        "allocatable": spec.capacity,
        "conditions": _ready_conditions(now),
        "addresses": [
            {"type": "InternalIP", "address": "127.0.0.1"},
            {"type": "Hostname", "address": spec.name},
        ],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": spec.kubelet_port}},
        "nodeInfo": {
            "machineID": spec.name,
            "systemUUID": spec.name,
            "bootID": spec.name,
            "kernelVersion": platform.release(),
            "osImage": "cairn devcluster",
            "containerRuntimeVersion": "cairn-process://0.1",
            "kubeletVersion": build.KUBERNETES_VERSION,
            "kubeProxyVersion": "",
            "operatingSystem": "linux",
            "architecture": "amd64",
        },
    }


class NodeKeeper:
    def __init__(
        self,
        *,
        core: client.CoreV1Api,
        coordination: client.CoordinationV1Api,
        nodes: list[NodeSpec],
    ) -> None:
        self.core = core
        self.coordination = coordination
        self.nodes = nodes
        self.stop = threading.Event()

    def register(self) -> None:
        now = _now().strftime("%Y-%m-%dT%H:%M:%SZ")
        for spec in self.nodes:
            labels = {
                "kubernetes.io/hostname": spec.name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                **spec.labels,
            }
            body = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": spec.name, "labels": labels},
                "spec": {"taints": node_taints(spec)},
            }
            try:
                self.core.create_node(body)
            except ApiException as exc:
                if exc.status != 409:
                    raise
                self.core.patch_node(
                    spec.name,
                    {"metadata": {"labels": labels}, "spec": {"taints": node_taints(spec)}},
                )
            self.core.patch_node_status(spec.name, {"status": node_status(spec, now=now)})
            self._renew_lease(spec)

    def _renew_lease(self, spec: NodeSpec) -> None:
        now = _now().strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": spec.name, "namespace": "kube-node-lease"},
            "spec": {
                "holderIdentity": spec.name,
                "leaseDurationSeconds": LEASE_SECONDS,
                "renewTime": now,
            },
        }
        try:
            self.coordination.patch_namespaced_lease(
                spec.name, "kube-node-lease", {"spec": body["spec"]}
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.coordination.create_namespaced_lease("kube-node-lease", body)

    def run(self) -> None:
        since_status = 0.0
        while not self.stop.wait(RENEW_SECONDS):
            since_status += RENEW_SECONDS
            for spec in self.nodes:
                try:
                    self._renew_lease(spec)
                    if since_status >= STATUS_SECONDS:
                        now = _now().strftime("%Y-%m-%dT%H:%M:%SZ")
                        self.core.patch_node_status(
                            spec.name, {"status": node_status(spec, now=now)}
                        )
                except Exception:  # the API may be restarting: try again next round
                    continue
            if since_status >= STATUS_SECONDS:
                since_status = 0.0
