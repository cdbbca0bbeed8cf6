"""Pure builders of a job's children: the objects ``jobplan`` asks ``jobapply`` to create.

Pure: a TrainingJob (+ attempt, rank, resume target) in, a typed Kubernetes
payload out. Tests compare whole objects. Names come from ``names``, env var
names from ``cairn.api.podenv`` (the contract with the trainer image).

Per job (stable names, re-ensured by every attempt): ServiceAccount, a Role
that may only get/patch this one TrainingJob's status (``resourceNames``), its
RoleBinding, the headless Service that gives each rank a DNS name, the
NetworkPolicy that admits only the job's own pods (``network_policy``), and the
Secret holding the job's manifest-signing keyring (created once, never
replaced: its key is drawn by ``jobapply`` at create time, not here; mounted
read-only into the trainer container of every rank pod, Ray head and workers
alike, and into no other container; docs/security.md).
Per attempt: one Pod per node rank.

Runtime ``ray`` (docs/ray.md): the same pods, names, gang and Service; rank 0
is the Ray head, the other ranks Ray workers. The container runs
``python -m cairn.trainer.raynode -- <command> <args>`` (the launcher starts
the Ray node and, on the head, runs the user's command as the driver), gets
the ``CAIRN_RAY_*`` env and an emptyDir at ``/tmp/ray`` for Ray's temp dir.

Pods meet the ``restricted`` Pod Security Standard by default (non-root,
RuntimeDefault seccomp, no privilege escalation, every capability dropped);
the overlay's ``securityContext``/``containerSecurityContext`` merge over those
defaults key by key, so a user can relax them where the namespace allows. The
trainer's termination message (``cairn.api.exitcodes``) is read from its
``terminationMessagePath``, or from the log tail when it wrote none.
"""

from typing import Any

from cairn.api import exitcodes, podenv, trainingjob
from cairn.operator.core import envvars, k8stypes, names

POD_SECURITY_DEFAULTS: dict[str, Any] = {
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}
"""The restricted profile's pod-level requirements (the image's USER is non-root)."""
RAY_PORT_NAME = "ray-gcs"
RAY_VOLUME_NAME = trainingjob.RAY_VOLUME_NAME
RAY_TOKEN_VOLUME = "cairn-ray-token"

CONTAINER_SECURITY_DEFAULTS: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
}
"""The restricted profile's container-level requirements (also given to the
overlay's init containers and sidecars, under their own securityContext)."""


def _merged(defaults: dict[str, Any], overlay: dict[str, Any] | None) -> dict[str, Any]:
    return {**defaults, **(overlay or {})}


def container_security(overlay: dict[str, Any] | None) -> dict[str, Any]:
    """The restricted defaults under the user's container securityContext. A
    privileged container cannot also forbid privilege escalation (the API
    server refuses the pair), so asking for ``privileged`` drops that default."""
    defaults = dict(CONTAINER_SECURITY_DEFAULTS)
    if (overlay or {}).get("privileged"):
        defaults.pop("allowPrivilegeEscalation")
    return _merged(defaults, overlay)


def pod_service_account(job: trainingjob.TrainingJob) -> str:
    """The ServiceAccount the pods run as: the overlay's, else ``<job>-trainer``."""
    overlay = job.spec.template
    if overlay is not None and overlay.service_account_name:
        return overlay.service_account_name
    return names.service_account_name(job.metadata.name)


def owner_reference(job: trainingjob.TrainingJob) -> k8stypes.OwnerReference:
    return {
        "apiVersion": trainingjob.API_VERSION,
        "kind": trainingjob.KIND,
        "name": job.metadata.name,
        "uid": job.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(
    job: trainingjob.TrainingJob, *, name: str, labels: dict[str, str] | None = None
) -> k8stypes.ObjectMeta:
    """A child's metadata: its name, the job's namespace and controller
    ownerReference, and the job's owner labels unless ``labels`` (pods) says
    otherwise."""
    return {
        "name": name,
        "namespace": job.metadata.namespace,
        "labels": names.owner_labels(job.metadata.name) if labels is None else labels,
        "ownerReferences": [owner_reference(job)],
    }


def service_account(job: trainingjob.TrainingJob) -> k8stypes.ServiceAccount:
    name = names.service_account_name(job.metadata.name)
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(job, name=name),
    }


def role(job: trainingjob.TrainingJob) -> k8stypes.Role:
    """Just enough for rank 0's writer to report on its own job."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(job, name=names.role_name(job.metadata.name)),
        "rules": [
            {
                "apiGroups": [trainingjob.GROUP],
                "resources": [f"{trainingjob.PLURAL}/status"],
                "resourceNames": [job.metadata.name],
                "verbs": ["get", "patch"],
            }
        ],
    }


def role_binding(job: trainingjob.TrainingJob) -> k8stypes.RoleBinding:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(job, name=names.role_name(job.metadata.name)),
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": names.role_name(job.metadata.name),
        },
        "subjects": [
            {
                "kind": "ServiceAccount",
                "name": pod_service_account(job),
                "namespace": job.metadata.namespace,
            }
        ],
    }


def _ports(job: trainingjob.TrainingJob) -> list[tuple[str, int]]:
    """(name, port) the pods listen on: c10d, plus the head's GCS for runtime ray."""
    ports = [(names.PORT_NAME, podenv.MASTER_PORT_DEFAULT)]
    if job.spec.runtime == "ray":
        ports.append((RAY_PORT_NAME, podenv.RAY_PORT_DEFAULT))
    return ports


def service(job: trainingjob.TrainingJob) -> k8stypes.Service:
    """Headless; publishes not-ready pods so rank 0 resolves before it is Ready."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(job, name=names.service_name(job.metadata.name)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": names.job_selector(job.metadata.name),
            "ports": [
                {"name": port_name, "port": port, "targetPort": port, "protocol": "TCP"}
                for port_name, port in _ports(job)
            ],
        },
    }


def manifest_key_secret(job: trainingjob.TrainingJob) -> k8stypes.Secret:
    """The job's keyring Secret, without data (``jobapply`` draws the key on create)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(job, name=names.manifest_key_secret_name(job.metadata.name)),
        "type": "Opaque",
    }


def ray_token_secret(job: trainingjob.TrainingJob) -> k8stypes.Secret:
    """A ray job's Ray auth token Secret, without data (``jobapply`` draws it on create)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(job, name=names.ray_token_secret_name(job.metadata.name)),
        "type": "Opaque",
        # Ray processes read the token when they start: a token changed under a
        # running attempt would lock its new worker processes out. Rotate by
        # deleting the Secret (a new one is drawn for the next attempt).
        "immutable": True,
    }


def network_policy(job: trainingjob.TrainingJob) -> k8stypes.NetworkPolicy:
    """Ingress to the job's pods only from the job's pods, every port (c10d,
    gloo/NCCL, Ray's fixed and random ports); nothing else connects into a
    rank pod (the operator reads the API server, probes come from the kubelet).
    A ray job that asked for the dashboard also admits its port from anywhere:
    the job's token guards it. Egress is the user's (docs/security.md, "The
    job's network boundary", also for why a label selector is enough)."""
    own_pods: k8stypes.LabelSelector = {"matchLabels": names.job_selector(job.metadata.name)}
    ingress: list[k8stypes.NetworkPolicyIngressRule] = [{"from": [{"podSelector": own_pods}]}]
    if job.spec.ray_settings.dashboard:  # spec.ray is refused unless runtime: ray
        ingress.append({"ports": [{"protocol": "TCP", "port": podenv.RAY_DASHBOARD_PORT}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(job, name=names.network_policy_name(job.metadata.name)),
        "spec": {"podSelector": own_pods, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def job_children(job: trainingjob.TrainingJob) -> list[k8stypes.Child]:
    """The per-job children, in creation order (the binding after its role). All
    come before the pods, and ``jobapply`` creates no pod after a per-job child
    failed: no attempt's pods are created before the job's NetworkPolicy exists."""
    return [
        service_account(job),
        role(job),
        role_binding(job),
        service(job),
        manifest_key_secret(job),
        *([ray_token_secret(job)] if job.spec.runtime == "ray" else []),
        network_policy(job),
    ]


MANIFEST_KEY_VOLUME = "cairn-manifest-key"


def _manifest_key_volume(job: trainingjob.TrainingJob) -> dict[str, object]:
    return {
        "name": MANIFEST_KEY_VOLUME,
        "secret": {
            "secretName": names.manifest_key_secret_name(job.metadata.name),
            # Readable by the container's (non-root, any) user; the volume is
            # mounted into the trainer container only.
            "defaultMode": 0o444,
            "items": [{"key": podenv.MANIFEST_KEYRING_FILE, "path": podenv.MANIFEST_KEYRING_FILE}],
        },
    }


def _manifest_key_mount() -> k8stypes.VolumeMount:
    return {"name": MANIFEST_KEY_VOLUME, "mountPath": podenv.MANIFEST_KEY_DIR, "readOnly": True}


def container_command(spec: trainingjob.TrainingJobSpec) -> list[str] | None:
    """The user's command, under the Ray launcher for runtime ray (its args follow
    it unchanged, so the launcher sees ``-- <command> <args>``)."""
    if spec.command is None:
        return None
    if spec.runtime == "ray":
        return ["python", "-m", podenv.RAYNODE_MODULE, "--", *spec.command]
    return list(spec.command)


def _checkpoint_volume(job: trainingjob.TrainingJob) -> dict[str, object]:
    volume = job.spec.checkpoint.volume
    if volume.persistent_volume_claim is not None:
        return {
            "name": trainingjob.CHECKPOINT_VOLUME_NAME,
            "persistentVolumeClaim": {"claimName": volume.persistent_volume_claim.claim_name},
        }
    empty: dict[str, object] = {}
    if volume.empty_dir is not None:
        empty = volume.empty_dir.model_dump(by_alias=True, exclude_none=True)
    return {"name": trainingjob.CHECKPOINT_VOLUME_NAME, "emptyDir": empty}


def _memory_volumes(job: trainingjob.TrainingJob) -> list[dict[str, object]]:
    """The in-memory tier's tmpfs (`medium: Memory`, sized by the spec), if enabled."""
    memory = job.spec.checkpoint.memory
    if not memory.enabled:
        return []
    empty: dict[str, object] = {"medium": "Memory"}
    if memory.size_limit is not None:
        empty["sizeLimit"] = memory.size_limit
    return [{"name": podenv.MEMORY_VOLUME_NAME, "emptyDir": empty}]


def _memory_mounts(job: trainingjob.TrainingJob) -> list[k8stypes.VolumeMount]:
    if not job.spec.checkpoint.memory.enabled:
        return []
    return [{"name": podenv.MEMORY_VOLUME_NAME, "mountPath": podenv.MEMORY_MOUNT_PATH}]


def _checkpoint_mount(job: trainingjob.TrainingJob) -> k8stypes.VolumeMount:
    mount: k8stypes.VolumeMount = {
        "name": trainingjob.CHECKPOINT_VOLUME_NAME,
        "mountPath": job.spec.checkpoint.mount_path,
    }
    pvc = job.spec.checkpoint.volume.persistent_volume_claim
    if pvc is not None and pvc.sub_path is not None:
        mount["subPath"] = pvc.sub_path
    return mount


def _trainer_container(
    job: trainingjob.TrainingJob,
    overlay: trainingjob.PodTemplateOverlay,
    *,
    attempt: int,
    rank: int,
    resume: podenv.ResumeTarget,
) -> k8stypes.Container:
    """The pod's one container: the user's image with Cairn's env, mounts and ports."""
    spec = job.spec
    container: k8stypes.Container = {
        "name": names.CONTAINER,
        "image": spec.image,
        "env": envvars.pod_env(job, attempt=attempt, rank=rank, resume=resume),
        "securityContext": container_security(overlay.container_security_context),
        "terminationMessagePath": exitcodes.TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "ports": [
            {"name": port_name, "containerPort": port, "protocol": "TCP"}
            for port_name, port in _ports(job)
        ],
        "volumeMounts": [
            _checkpoint_mount(job),
            _manifest_key_mount(),
            *_memory_mounts(job),
            *_ray_mounts(job),
            *(m.model_dump(by_alias=True) for m in overlay.volume_mounts or ()),
        ],
    }
    command = container_command(spec)
    if command is not None:
        container["command"] = command
    if spec.args is not None:
        container["args"] = list(spec.args)
    if spec.resources is not None:
        container["resources"] = spec.resources.model_dump(by_alias=True, exclude_none=True)
    if overlay.env_from:
        container["envFrom"] = [dict(e) for e in overlay.env_from]
    return container


def pod(
    job: trainingjob.TrainingJob, *, attempt: int, rank: int, resume: podenv.ResumeTarget
) -> k8stypes.Pod:
    """One rank of one attempt. ``restartPolicy: Never``: restarts are gang-wide."""
    spec = job.spec
    name = job.metadata.name
    overlay = spec.template or trainingjob.PodTemplateOverlay()
    meta = overlay.metadata or trainingjob.ObjectMetaOverlay()
    pod_name = names.pod_name(job=name, attempt=attempt, rank=rank)
    labels = {**(meta.labels or {}), **names.pod_labels(job=name, attempt=attempt, rank=rank)}
    metadata = _meta(job, name=pod_name, labels=labels)
    if meta.annotations:
        metadata["annotations"] = dict(meta.annotations)
    container = _trainer_container(job, overlay, attempt=attempt, rank=rank, resume=resume)
    pod_spec: k8stypes.PodSpec = {
        "restartPolicy": "Never",
        "hostname": pod_name,
        "subdomain": names.service_name(name),
        "serviceAccountName": pod_service_account(job),
        # Only rank 0 reports status; the other ranks get no API credentials.
        "automountServiceAccountToken": rank == 0,
        "terminationGracePeriodSeconds": spec.checkpoint.final_checkpoint_grace_seconds,
        "securityContext": _merged(POD_SECURITY_DEFAULTS, overlay.security_context),
        "containers": [container],
        "volumes": [
            _checkpoint_volume(job),
            _manifest_key_volume(job),
            *_memory_volumes(job),
            *_ray_volumes(job),
            *(v.model_dump(by_alias=True) for v in overlay.volumes or ()),
        ],
    }
    if overlay.node_selector:
        pod_spec["nodeSelector"] = dict(overlay.node_selector)
    if overlay.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in overlay.tolerations]
    if overlay.affinity:
        pod_spec["affinity"] = dict(overlay.affinity)
    if overlay.priority_class_name:
        pod_spec["priorityClassName"] = overlay.priority_class_name
    if overlay.scheduler_name:
        pod_spec["schedulerName"] = overlay.scheduler_name
    if overlay.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [dict(s) for s in overlay.image_pull_secrets]
    _scheduling_extras(pod_spec, overlay)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def _ray_mounts(job: trainingjob.TrainingJob) -> list[k8stypes.VolumeMount]:
    if job.spec.runtime != "ray":
        return []
    return [
        {"name": RAY_VOLUME_NAME, "mountPath": podenv.RAY_TEMP_DIR},
        {"name": RAY_TOKEN_VOLUME, "mountPath": podenv.RAY_TOKEN_DIR, "readOnly": True},
    ]


def _ray_volumes(job: trainingjob.TrainingJob) -> list[dict[str, object]]:
    if job.spec.runtime != "ray":
        return []
    token_volume: dict[str, object] = {
        "name": RAY_TOKEN_VOLUME,
        "secret": {
            "secretName": names.ray_token_secret_name(job.metadata.name),
            # As the manifest key: readable by the container's (any non-root)
            # user, mounted into the trainer container only.
            "defaultMode": 0o444,
            "items": [{"key": podenv.RAY_TOKEN_KEY, "path": podenv.RAY_TOKEN_KEY}],
        },
    }
    return [{"name": RAY_VOLUME_NAME, "emptyDir": {}}, token_volume]


def _restricted(container: dict[str, Any]) -> dict[str, Any]:
    return {
        **container,
        "securityContext": container_security(container.get("securityContext")),
    }


def _scheduling_extras(pod_spec: k8stypes.PodSpec, overlay: trainingjob.PodTemplateOverlay) -> None:
    """The overlay's opaque additions, passed through (the API server validates them)."""
    if overlay.topology_spread_constraints:
        pod_spec["topologySpreadConstraints"] = [
            dict(c) for c in overlay.topology_spread_constraints
        ]
    if overlay.runtime_class_name:
        pod_spec["runtimeClassName"] = overlay.runtime_class_name
    if overlay.scheduling_gates:
        pod_spec["schedulingGates"] = [dict(g) for g in overlay.scheduling_gates]
    init = [_restricted(c.model_dump(by_alias=True)) for c in overlay.init_containers or ()]
    # Native sidecars (1.29+): init containers that keep running beside the trainer.
    init += [
        {**_restricted(c.model_dump(by_alias=True)), "restartPolicy": "Always"}
        for c in overlay.sidecars or ()
    ]
    if init:
        pod_spec["initContainers"] = init


def attempt_pods(
    job: trainingjob.TrainingJob, *, attempt: int, resume: podenv.ResumeTarget
) -> list[k8stypes.Pod]:
    return [pod(job, attempt=attempt, rank=rank, resume=resume) for rank in range(job.spec.nodes)]
