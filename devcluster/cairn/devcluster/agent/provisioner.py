"""The default StorageClass and its local-path provisioner.

`standard` (default class, `WaitForFirstConsumer`) is created at start. When
the scheduler has picked a node for a pod using an unbound claim of that
class (annotation `volume.kubernetes.io/selected-node`), a PersistentVolume
backed by a directory under the state dir is created with a `claimRef` to
the claim, and the controller-manager binds them, as with any external
provisioner. A released volume whose policy is Delete loses its directory
and object.
"""

import logging
import pathlib
import shutil
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

log = logging.getLogger("cairn.devcluster.agent")
PROVISIONER = "cairn.dev/local-path"
STORAGE_CLASS = "standard"
SELECTED_NODE = "volume.kubernetes.io/selected-node"


def ensure_storage_class(storage: client.StorageV1Api) -> None:
    body = {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {
            "name": STORAGE_CLASS,
            "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
        },
        "provisioner": PROVISIONER,
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "WaitForFirstConsumer",
    }
    try:
        storage.create_storage_class(body)
    except ApiException as exc:
        if exc.status != 409:
            raise


class Provisioner:
    def __init__(
        self, *, core: client.CoreV1Api, storage: client.StorageV1Api, root: pathlib.Path
    ) -> None:
        self.core = core
        self.storage = storage
        self.root = root

    def _ours(self, class_name: str | None) -> bool:
        return (class_name or STORAGE_CLASS) == STORAGE_CLASS

    def on_claim(self, event: str, pvc: dict[str, Any]) -> None:
        if event == "DELETED":
            return
        meta, spec = pvc["metadata"], pvc["spec"]
        annotations = meta.get("annotations") or {}
        if spec.get("volumeName") or SELECTED_NODE not in annotations:
            return
        if not self._ours(spec.get("storageClassName")):
            return
        name = f"pvc-{meta['uid']}"
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o777)
        size = ((spec.get("resources") or {}).get("requests") or {}).get("storage", "1Gi")
        body = {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {
                "name": name,
                "annotations": {"pv.kubernetes.io/provisioned-by": PROVISIONER},
            },
            "spec": {
                "capacity": {"storage": size},
                "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Delete",
                "storageClassName": STORAGE_CLASS,
                "volumeMode": spec.get("volumeMode", "Filesystem"),
                "hostPath": {"path": str(path), "type": "DirectoryOrCreate"},
                "claimRef": {
                    "apiVersion": "v1",
                    "kind": "PersistentVolumeClaim",
                    "namespace": meta["namespace"],
                    "name": meta["name"],
                    "uid": meta["uid"],
                },
            },
        }
        try:
            self.core.create_persistent_volume(body)
            log.info("provisioned volume", extra={"pv": name, "claim": meta["name"]})
        except ApiException as exc:
            if exc.status != 409:
                raise

    def on_volume(self, event: str, pv: dict[str, Any]) -> None:
        if event == "DELETED":
            return
        annotations = pv["metadata"].get("annotations") or {}
        if annotations.get("pv.kubernetes.io/provisioned-by") != PROVISIONER:
            return
        phase = (pv.get("status") or {}).get("phase")
        if phase == "Released" and pv["spec"].get("persistentVolumeReclaimPolicy") == "Delete":
            path = pathlib.Path(pv["spec"]["hostPath"]["path"])
            if path.is_relative_to(self.root):
                shutil.rmtree(path, ignore_errors=True)
            try:
                self.core.delete_persistent_volume(pv["metadata"]["name"])
            except ApiException as exc:
                if exc.status != 404:
                    raise
