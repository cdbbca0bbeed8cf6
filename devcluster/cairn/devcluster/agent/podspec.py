"""Pure: what a container of a pod runs — argv, environment, mounts, working dir.

Given the pod (as the API returns it, camelCase dict), the container, the
pod's IP, the resolved Secrets and ConfigMaps, and where each volume was
materialized, compute a `ContainerPlan`. Kubernetes semantics: `command`
replaces the image entrypoint (there are no images here, so a container
without `command` is an error the worker reports), `$(VAR)` in command, args
and env values expands from earlier env entries (`$$` escapes), env from
`fieldRef`, `resourceFieldRef`, `secretKeyRef`, `configMapKeyRef`, and
`envFrom`, and the kubelet's `KUBERNETES_SERVICE_*` variables.
"""

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

KUBERNETES_SERVICE_HOST = "10.244.0.1"
KUBERNETES_SERVICE_PORT = "6443"
DEFAULT_TERMINATION_MESSAGE_PATH = "/dev/termination-log"

Obj = dict[str, Any]


class SpecError(ValueError):
    """A pod spec this agent cannot run; the message becomes the container's reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Mount:
    source: str
    target: str
    read_only: bool


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ContainerPlan:
    name: str
    argv: tuple[str, ...]
    env: dict[str, str]
    mounts: tuple[Mount, ...]
    working_dir: str | None
    hostname: str


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: unknown references stay as written."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))

    return _VAR.sub(replace, text)


def _field(pod: Obj, path: str, *, pod_ip: str, host_ip: str) -> str:
    meta, spec = pod["metadata"], pod["spec"]
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if path in simple:
        return str(simple[path])
    match = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if match:
        return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
    raise SpecError("CreateContainerConfigError", f"unsupported fieldRef {path!r}")


def _quantity(value: str) -> float:
    units = {
        "m": 1e-3,
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
        "k": 1e3,
        "M": 1e6,
        "G": 1e9,
    }
    for suffix, factor in units.items():
        if value.endswith(suffix):
            return float(value[: -len(suffix)]) * factor
    return float(value)


def _resource_field(container: Obj, ref: Obj) -> str:
    kind, _, resource = ref["resource"].partition(".")
    value = ((container.get("resources") or {}).get(kind) or {}).get(resource)
    if value is None:
        return "0"
    divisor = _quantity(str(ref.get("divisor", "1")))
    return str(max(1, int(-(-_quantity(str(value)) // divisor))))


def _lookup(
    store: Mapping[tuple[str, str], Mapping[str, str]],
    *,
    namespace: str,
    ref: Obj,
    kind: str,
) -> str | None:
    data = store.get((namespace, ref["name"]))
    if data is None or ref["key"] not in data:
        if ref.get("optional"):
            return None
        missing = "not found" if data is None else f"has no key {ref['key']!r}"
        raise SpecError("CreateContainerConfigError", f"{kind} {ref['name']!r} {missing}")
    return data[ref["key"]]


def container_env(
    *,
    pod: Obj,
    container: Obj,
    pod_ip: str,
    host_ip: str,
    secrets: Mapping[tuple[str, str], Mapping[str, str]],
    config_maps: Mapping[tuple[str, str], Mapping[str, str]],
    base: Mapping[str, str],
) -> dict[str, str]:
    namespace = pod["metadata"]["namespace"]
    env = dict(base)
    env["KUBERNETES_SERVICE_HOST"] = KUBERNETES_SERVICE_HOST
    env["KUBERNETES_SERVICE_PORT"] = KUBERNETES_SERVICE_PORT
    env["KUBERNETES_SERVICE_PORT_HTTPS"] = KUBERNETES_SERVICE_PORT
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        ref = source.get("secretRef") or source.get("configMapRef")
        store = secrets if "secretRef" in source else config_maps
        data = store.get((namespace, ref["name"]))
        if data is None:
            if ref.get("optional"):
                continue
            raise SpecError("CreateContainerConfigError", f"envFrom {ref['name']!r} not found")
        env.update({prefix + k: v for k, v in data.items()})
    for var in container.get("env") or []:
        name = var["name"]
        if "value" in var or "valueFrom" not in var:
            env[name] = expand(var.get("value", ""), env)
            continue
        source = var["valueFrom"]
        value: str | None
        if "fieldRef" in source:
            value = _field(pod, source["fieldRef"]["fieldPath"], pod_ip=pod_ip, host_ip=host_ip)
        elif "resourceFieldRef" in source:
            value = _resource_field(container, source["resourceFieldRef"])
        elif "secretKeyRef" in source:
            value = _lookup(secrets, namespace=namespace, ref=source["secretKeyRef"], kind="secret")
        elif "configMapKeyRef" in source:
            value = _lookup(
                config_maps, namespace=namespace, ref=source["configMapKeyRef"], kind="configmap"
            )
        else:
            raise SpecError("CreateContainerConfigError", f"env {name}: unsupported valueFrom")
        if value is not None:
            env[name] = value
    return env


def plan_container(
    *,
    pod: Obj,
    container: Obj,
    pod_ip: str,
    host_ip: str,
    hostname: str,
    secrets: Mapping[tuple[str, str], Mapping[str, str]],
    config_maps: Mapping[tuple[str, str], Mapping[str, str]],
    volume_dirs: Mapping[str, str],
    base_env: Mapping[str, str],
    termination_file: str | None = None,
) -> ContainerPlan:
    """The container's plan. ``termination_file``: a host file mounted at the
    container's ``terminationMessagePath`` (as the kubelet does), so what the
    program writes there is its own and the agent can read it back."""
    if not container.get("command"):
        raise SpecError(
            "CreateContainerError",
            "no command: the devcluster runs no images, so a container must set `command`",
        )
    env = container_env(
        pod=pod,
        container=container,
        pod_ip=pod_ip,
        host_ip=host_ip,
        secrets=secrets,
        config_maps=config_maps,
        base=base_env,
    )
    argv = tuple(expand(a, env) for a in [*container["command"], *(container.get("args") or [])])
    mounts = []
    for mount in container.get("volumeMounts") or []:
        source = volume_dirs.get(mount["name"])
        if source is None:
            raise SpecError("CreateContainerConfigError", f"volume {mount['name']!r} not found")
        if mount.get("subPath"):
            sub = mount["subPath"]
            if sub.startswith("/") or ".." in sub.split("/"):
                raise SpecError("CreateContainerConfigError", f"subPath {sub!r} escapes its volume")
            source = f"{source}/{sub}"
        mounts.append(
            Mount(source=source, target=mount["mountPath"], read_only=bool(mount.get("readOnly")))
        )
    if termination_file is not None:
        target = container.get("terminationMessagePath") or DEFAULT_TERMINATION_MESSAGE_PATH
        mounts.append(Mount(source=termination_file, target=target, read_only=False))
    return ContainerPlan(
        name=container["name"],
        argv=argv,
        env=env,
        mounts=tuple(mounts),
        working_dir=container.get("workingDir"),
        hostname=hostname,
    )
