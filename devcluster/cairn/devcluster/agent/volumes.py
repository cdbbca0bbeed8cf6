"""Materializes a pod's volumes as directories under the agent's state.

emptyDir: a fresh directory per pod; with `medium: Memory` a tmpfs mounted
there, sized by `sizeLimit` as the kubelet sizes memory-backed emptyDirs,
unmounted by `release` when the pod ends. persistentVolumeClaim: the bound
PersistentVolume's directory, so every pod claiming it shares it. hostPath:
the host path itself. secret, configMap, downwardAPI and projected volumes
(including the ServiceAccount token from the TokenRequest API with the
requested audience and expiry, bound to the pod): files written atomically
into a per-pod directory, refreshed by `refresh_projected` before tokens
expire. The result maps volume name to directory; `podspec` mounts them.
"""

import base64
import contextlib
import os
import pathlib
import subprocess
from collections.abc import Mapping
from typing import Any

from kubernetes import client
from kubernetes.utils import quantity

from cairn.devcluster.agent import podspec

Obj = dict[str, Any]
DEFAULT_TOKEN_SECONDS = 3607
MOUNT_TIMEOUT_SECONDS = 10.0


def _write(directory: pathlib.Path, files: Mapping[str, bytes], *, mode: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for rel, content in files.items():
        if rel.startswith("/") or ".." in rel.split("/"):
            raise podspec.SpecError("CreateContainerConfigError", f"volume path {rel!r} escapes")
        target = directory / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_bytes(content)
        tmp.chmod(mode)
        os.replace(tmp, target)


def _select(data: Mapping[str, bytes], items: list[Obj] | None) -> dict[str, bytes]:
    if not items:
        return dict(data)
    return {item["path"]: data[item["key"]] for item in items if item["key"] in data}


def _secret_data(core: client.CoreV1Api, namespace: str, name: str) -> dict[str, bytes]:
    secret = core.read_namespaced_secret(name, namespace)
    return {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}


def _config_map_data(core: client.CoreV1Api, namespace: str, name: str) -> dict[str, bytes]:
    cm = core.read_namespaced_config_map(name, namespace)
    data = {k: v.encode() for k, v in (cm.data or {}).items()}
    data.update({k: base64.b64decode(v) for k, v in (cm.binary_data or {}).items()})
    return data


def env_sources(
    *, core: client.CoreV1Api, namespace: str, containers: list[Obj]
) -> tuple[dict[tuple[str, str], dict[str, str]], dict[tuple[str, str], dict[str, str]]]:
    """Read the Secrets and ConfigMaps that containers' env and envFrom name.

    A missing one is left out: `podspec` decides whether that is an error
    (it is unless the reference is optional).
    """
    secrets: dict[tuple[str, str], dict[str, str]] = {}
    config_maps: dict[tuple[str, str], dict[str, str]] = {}
    for container in containers:
        refs = [v.get("valueFrom", {}) for v in container.get("env") or []]
        refs += container.get("envFrom") or []
        for ref in refs:
            for key in ("secretKeyRef", "secretRef"):
                if key in ref and (namespace, ref[key]["name"]) not in secrets:
                    with contextlib.suppress(client.ApiException):
                        data = _secret_data(core, namespace, ref[key]["name"])
                        secrets[(namespace, ref[key]["name"])] = {
                            k: v.decode(errors="replace") for k, v in data.items()
                        }
            for key in ("configMapKeyRef", "configMapRef"):
                if key in ref and (namespace, ref[key]["name"]) not in config_maps:
                    with contextlib.suppress(client.ApiException):
                        data = _config_map_data(core, namespace, ref[key]["name"])
                        config_maps[(namespace, ref[key]["name"])] = {
                            k: v.decode(errors="replace") for k, v in data.items()
                        }
    return secrets, config_maps


def _downward(pod: Obj, items: list[Obj], *, pod_ip: str) -> dict[str, bytes]:
    out = {}
    for item in items:
        if "fieldRef" in item:
            value = podspec._field(
                pod, item["fieldRef"]["fieldPath"], pod_ip=pod_ip, host_ip="127.0.0.1"
            )
        else:
            container = next(
                c
                for c in pod["spec"]["containers"]
                if c["name"] == item["resourceFieldRef"].get("containerName", c["name"])
            )
            value = podspec._resource_field(container, item["resourceFieldRef"])
        out[item["path"]] = value.encode()
    return out


def _token(core: client.CoreV1Api, pod: Obj, source: Obj) -> bytes:
    meta = pod["metadata"]
    audience = source.get("audience")
    request = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(
            audiences=[audience] if audience else [],
            expiration_seconds=source.get("expirationSeconds", DEFAULT_TOKEN_SECONDS),
            bound_object_ref=client.V1BoundObjectReference(
                api_version="v1", kind="Pod", name=meta["name"], uid=meta["uid"]
            ),
        )
    )
    account = pod["spec"].get("serviceAccountName") or "default"
    response = core.create_namespaced_service_account_token(account, meta["namespace"], request)
    return str(response.status.token).encode()


def _projected(core: client.CoreV1Api, pod: Obj, spec: Obj, *, pod_ip: str) -> dict[str, bytes]:
    namespace = pod["metadata"]["namespace"]
    files: dict[str, bytes] = {}
    for source in spec.get("sources") or []:
        if "serviceAccountToken" in source:
            sat = source["serviceAccountToken"]
            files[sat["path"]] = _token(core, pod, sat)
        elif "configMap" in source:
            ref = source["configMap"]
            files.update(_select(_config_map_data(core, namespace, ref["name"]), ref.get("items")))
        elif "secret" in source:
            ref = source["secret"]
            files.update(_select(_secret_data(core, namespace, ref["name"]), ref.get("items")))
        elif "downwardAPI" in source:
            files.update(_downward(pod, source["downwardAPI"].get("items") or [], pod_ip=pod_ip))
    return files


def _pvc_dir(core: client.CoreV1Api, namespace: str, claim: str) -> str:
    pvc = core.read_namespaced_persistent_volume_claim(claim, namespace)
    if not pvc.spec.volume_name:
        raise podspec.SpecError("ContainerCreating", f"claim {claim!r} is not bound yet")
    pv = core.read_persistent_volume(pvc.spec.volume_name)
    source = pv.spec.host_path or pv.spec.local
    if source is None:
        raise podspec.SpecError("CreateContainerConfigError", f"PV {pv.metadata.name} has no path")
    pathlib.Path(source.path).mkdir(parents=True, exist_ok=True)
    return str(source.path)


def materialize(
    *, core: client.CoreV1Api, pod: Obj, pod_dir: pathlib.Path, pod_ip: str
) -> dict[str, str]:
    namespace = pod["metadata"]["namespace"]
    dirs: dict[str, str] = {}
    for volume in pod["spec"].get("volumes") or []:
        name = volume["name"]
        target = pod_dir / "volumes" / name
        mode = 0o644
        if "emptyDir" in volume:
            target.mkdir(parents=True, exist_ok=True)
            if (volume["emptyDir"] or {}).get("medium") == "Memory":
                _mount_tmpfs(target, size_limit=volume["emptyDir"].get("sizeLimit"))
            target.chmod(0o777)
        elif "hostPath" in volume:
            path = pathlib.Path(volume["hostPath"]["path"])
            if volume["hostPath"].get("type") in ("DirectoryOrCreate", "", None):
                path.mkdir(parents=True, exist_ok=True)
            dirs[name] = str(path)
            continue
        elif "persistentVolumeClaim" in volume:
            dirs[name] = _pvc_dir(core, namespace, volume["persistentVolumeClaim"]["claimName"])
            continue
        elif "secret" in volume:
            ref = volume["secret"]
            data = _secret_data(core, namespace, ref["secretName"])
            _write(target, _select(data, ref.get("items")), mode=ref.get("defaultMode", mode))
        elif "configMap" in volume:
            ref = volume["configMap"]
            data = _config_map_data(core, namespace, ref["name"])
            _write(target, _select(data, ref.get("items")), mode=ref.get("defaultMode", mode))
        elif "downwardAPI" in volume:
            items = volume["downwardAPI"].get("items") or []
            _write(target, _downward(pod, items, pod_ip=pod_ip), mode=0o644)
        elif "projected" in volume:
            spec = volume["projected"]
            files = _projected(core, pod, spec, pod_ip=pod_ip)
            _write(target, files, mode=spec.get("defaultMode", 0o644))
        else:
            kinds = sorted(k for k in volume if k != "name")
            raise podspec.SpecError(
                "CreateContainerConfigError", f"volume {name!r}: unsupported type {kinds}"
            )
        dirs[name] = str(target)
    return dirs


def _mount_tmpfs(target: pathlib.Path, *, size_limit: str | None) -> None:
    """A tmpfs at `target` (idempotent: a retried setup finds it mounted)."""
    if os.path.ismount(target):
        return
    options = "mode=0777"
    if size_limit:
        options += f",size={int(quantity.parse_quantity(size_limit))}"
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)],
            check=True,
            capture_output=True,
            timeout=MOUNT_TIMEOUT_SECONDS,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or str(exc).encode()
        raise podspec.SpecError(
            "CreateContainerConfigError",
            f"emptyDir medium Memory at {target.name}: tmpfs mount failed: "
            f"{detail.decode(errors='replace').strip()}",
        ) from exc


def release(root: pathlib.Path) -> None:
    """Unmount every mount under `root` (a pod's memory-backed emptyDirs), deepest first."""
    prefix = f"{root.resolve()}/"
    with open("/proc/self/mounts", encoding="utf-8") as mounts:
        points = [line.split()[1] for line in mounts if line.split()[1].startswith(prefix)]
    for point in sorted(points, key=len, reverse=True):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(
                ["umount", "-l", point],
                check=False,
                capture_output=True,
                timeout=MOUNT_TIMEOUT_SECONDS,
            )


def refresh_projected(
    *, core: client.CoreV1Api, pod: Obj, pod_dir: pathlib.Path, pod_ip: str
) -> None:
    """Rewrite projected volumes (new tokens) in place; the bind mounts see the files."""
    for volume in pod["spec"].get("volumes") or []:
        if "projected" in volume:
            spec = volume["projected"]
            _write(
                pod_dir / "volumes" / volume["name"],
                _projected(core, pod, spec, pod_ip=pod_ip),
                mode=spec.get("defaultMode", 0o644),
            )


def token_refresh_seconds(pod: Obj) -> float:
    """Refresh at 80 % of the shortest requested token lifetime, like the kubelet."""
    lifetimes = [
        source["serviceAccountToken"].get("expirationSeconds", DEFAULT_TOKEN_SECONDS)
        for volume in pod["spec"].get("volumes") or []
        for source in (volume.get("projected") or {}).get("sources") or []
        if "serviceAccountToken" in source
    ]
    return 0.8 * min(lifetimes) if lifetimes else float("inf")
