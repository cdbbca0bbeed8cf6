"""The environment of a job's pods: the contract with the trainer image.

Pure: a TrainingJob (+ attempt, rank, resume target) in, the container's
``env`` out, in a fixed order (identity and rendezvous, checkpointing, Ray,
upload, then the user's own; ``CAIRN_*`` is reserved). The names come from
``cairn.api.podenv``; credentials only ever as Secret references.
``builders.pod`` puts the list into the trainer container.
"""

from cairn.api import checkpointspec, podenv, trainingjob
from cairn.operator.core import k8stypes, names


def _value(name: str, value: str | int) -> k8stypes.EnvVar:
    return {"name": name, "value": str(value)}


def _secret(name: str, *, secret: str, key: str) -> k8stypes.EnvVar:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def pod_env(
    job: trainingjob.TrainingJob, *, attempt: int, rank: int, resume: podenv.ResumeTarget
) -> list[k8stypes.EnvVar]:
    """The contract with the trainer image; user env follows (CAIRN_* is reserved).
    In order: identity and rendezvous, checkpointing, Ray, upload, the user's."""
    spec = job.spec
    env = _rendezvous_env(job, attempt=attempt, rank=rank)
    env += _checkpoint_env(spec.checkpoint, rank=rank, resume=resume)
    if spec.runtime == "ray":
        env += ray_env(spec.ray_settings)
    ckpt = spec.checkpoint
    if ckpt.interval_steps is not None:
        env.append(_value(podenv.CHECKPOINT_INTERVAL_STEPS, ckpt.interval_steps))
    if ckpt.interval_seconds is not None:
        env.append(_value(podenv.CHECKPOINT_INTERVAL_SECONDS, ckpt.interval_seconds))
    if ckpt.retention.local.max_bytes is not None:
        env.append(_value(podenv.MAX_BYTES, ckpt.retention.local.max_bytes))
    if ckpt.upload is not None:
        env += _upload_env(ckpt.upload)
    for user in spec.env or ():
        entry: k8stypes.EnvVar = {"name": user.name}
        if user.value_from is not None:
            entry["valueFrom"] = dict(user.value_from)
        else:
            entry["value"] = user.value or ""
        env.append(entry)
    return env


def _rendezvous_env(
    job: trainingjob.TrainingJob, *, attempt: int, rank: int
) -> list[k8stypes.EnvVar]:
    """Who the pod is, and torchrun's rendezvous (both the CAIRN_ and PET_ names)."""
    spec = job.spec
    name = job.metadata.name
    master = names.master_addr(job=name, namespace=job.metadata.namespace, attempt=attempt)
    port = podenv.MASTER_PORT_DEFAULT
    env: list[k8stypes.EnvVar] = [
        _value(podenv.JOB_NAME, name),
        _value(podenv.NAMESPACE, job.metadata.namespace),
        _value(podenv.JOB_UID, job.metadata.uid),
        _value(podenv.ATTEMPT, attempt),
        {"name": podenv.POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": podenv.POD_UID, "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        _value(podenv.NODE_RANK, rank),
        _value(podenv.NNODES, spec.nodes),
        _value(podenv.NPROC_PER_NODE, spec.procs_per_node),
        _value(podenv.RUNTIME, spec.runtime),
        _value(podenv.MASTER_ADDR_CAIRN, master),
        _value(podenv.MASTER_PORT_CAIRN, port),
        _value(podenv.PET_NNODES, spec.nodes),
        _value(podenv.PET_NPROC_PER_NODE, spec.procs_per_node),
        _value(podenv.PET_NODE_RANK, rank),
        *_torchrun_rendezvous(job, attempt=attempt, rank=rank, master=master, port=port),
        _value(podenv.MASTER_ADDR, master),
        _value(podenv.MASTER_PORT, port),
        _value(podenv.WORLD_SIZE, spec.nodes * spec.procs_per_node),
    ]
    if spec.procs_per_node == 1:
        env += [
            _value(podenv.RANK, rank),
            _value(podenv.LOCAL_RANK, 0),
            _value(podenv.LOCAL_WORLD_SIZE, 1),
        ]
    return env


RDZV_KEEP_ALIVE_SECONDS = 1
RDZV_KEEP_ALIVE_MISSES = 5
"""c10d drops a node whose agent missed this many heartbeats of this interval
(torch's defaults: 5 s x 3). Until it does, a pod replaced in place waits on
the redundancy list: the round still counts the lost node as a participant
(measured on the devcluster: 9 s of the 17 s back to training). 5 s, not
less: a live agent's heartbeat thread must not miss 5 beats under load."""


def _torchrun_rendezvous(
    job: trainingjob.TrainingJob, *, attempt: int, rank: int, master: str, port: int
) -> list[k8stypes.EnvVar]:
    """torchrun's rendezvous and --max-restarts (the in-place budget per attempt).

    Without in-place restarts: static rendezvous on the master, as always. With
    them (docs/operator.md, "In-place restarts"): c10d rendezvous, hosted by
    rank 0's agent on the master port, one run id per attempt. Static cannot
    restart in place: its store is reused across restarts with the same keys,
    so a restarted rank reads its peers' stale addresses (measured on the
    devcluster: connectFullMesh refused, then the budget is spent). c10d starts
    a new round (a fresh worker store) on every node when one node's agent
    rejoins. No PET_MASTER_*: they would override the round's store. And a
    fresh worker store per round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): by
    default c10d reuses one across rounds, with the same stale keys."""
    budget = job.spec.torchrun_settings.max_in_place_restarts
    if job.spec.runtime != "torchrun" or budget == 0:
        return [
            _value(podenv.PET_MASTER_ADDR, master),
            _value(podenv.PET_MASTER_PORT, port),
            _value(podenv.PET_MAX_RESTARTS, 0),
        ]
    return [
        _value(podenv.PET_RDZV_BACKEND, "c10d"),
        _value(podenv.PET_RDZV_ENDPOINT, f"{master}:{port}"),
        _value(podenv.PET_RDZV_ID, f"{job.metadata.uid}-a{attempt}"),
        _value(
            podenv.PET_RDZV_CONF,
            f"is_host={1 if rank == 0 else 0},keep_alive_interval={RDZV_KEEP_ALIVE_SECONDS},"
            f"keep_alive_max_attempt={RDZV_KEEP_ALIVE_MISSES}",
        ),
        _value(podenv.PET_MAX_RESTARTS, budget),
        _value(podenv.TORCH_DISABLE_SHARE_RDZV_TCP_STORE, 1),
    ]


def _checkpoint_env(
    ckpt: checkpointspec.CheckpointSpec, *, rank: int, resume: podenv.ResumeTarget
) -> list[k8stypes.EnvVar]:
    """The writer's settings and what to resume from."""
    env: list[k8stypes.EnvVar] = [
        _value(podenv.CHECKPOINT_DIR, ckpt.mount_path),
        _value(podenv.ASYNC_MODE, ckpt.async_mode),
        _value(podenv.KEEP_LAST, ckpt.retention.local.keep_last),
        _value(podenv.FINAL_CHECKPOINT_GRACE_SECONDS, ckpt.final_checkpoint_grace_seconds),
        _value(podenv.RESUME_FROM, podenv.format_resume(resume)),
        # The path of the keyring file, never the key (docs/security.md).
        _value(
            podenv.MANIFEST_KEYRING, f"{podenv.MANIFEST_KEY_DIR}/{podenv.MANIFEST_KEYRING_FILE}"
        ),
        _value(podenv.REPORT_STATUS, 1 if rank == 0 else 0),
        _value(podenv.STATUS_INTERVAL_SECONDS, ckpt.status_interval_seconds),
    ]
    if resume.sha256 is not None:
        env.append(_value(podenv.RESUME_SHA256, resume.sha256))
    if ckpt.memory.enabled:
        env.append(_value(podenv.MEMORY_DIR, podenv.MEMORY_MOUNT_PATH))
        env.append(_value(podenv.MEMORY_REPLICAS, ckpt.memory.replicas))
    return env


def _upload_env(upload: checkpointspec.UploadSpec) -> list[k8stypes.EnvVar]:
    """Where and how to upload; credentials only as Secret references."""
    env: list[k8stypes.EnvVar] = [
        _value(podenv.UPLOAD_URI, upload.uri),
        _value(podenv.UPLOAD_CONCURRENCY, upload.concurrency),
        _value(podenv.UPLOAD_ON_FAILURE, upload.on_failure),
        _value(podenv.UPLOAD_STALL_SECONDS, upload.stall_seconds),
    ]
    if upload.interval_steps is not None:
        env.append(_value(podenv.UPLOAD_INTERVAL_STEPS, upload.interval_steps))
    if upload.endpoint is not None:
        env.append(_value(podenv.AWS_ENDPOINT_URL_S3, upload.endpoint))
    if upload.region is not None:
        env.append(_value(podenv.AWS_REGION, upload.region))
    ref = upload.credentials_secret_ref
    if ref is not None:
        env += [
            _secret(podenv.AWS_ACCESS_KEY_ID, secret=ref.name, key=ref.access_key_id_key),
            _secret(podenv.AWS_SECRET_ACCESS_KEY, secret=ref.name, key=ref.secret_access_key_key),
        ]
    return env


RAY_TOKEN_PATH = f"{podenv.RAY_TOKEN_DIR}/{podenv.RAY_TOKEN_KEY}"
"""Where the job's Ray token Secret is mounted (``builders``) and read."""


def ray_env(ray: trainingjob.RaySpec) -> list[k8stypes.EnvVar]:
    """The launcher's settings (``cairn.trainer.raynode``); unset fields stay unset."""
    env: list[k8stypes.EnvVar] = [
        {"name": podenv.POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        _value(podenv.RAY_PORT, podenv.RAY_PORT_DEFAULT),
        _value(podenv.RAY_MAX_INPLACE_RESTARTS, ray.max_in_place_restarts),
        # Token auth (docs/security.md, "Ray token auth"): the launcher enforces
        # it from CAIRN_RAY_TOKEN_FILE; Ray's own two variables are set too, so a
        # `ray` command run in the pod (kubectl exec) joins with the same token.
        _value(podenv.RAY_TOKEN_FILE, RAY_TOKEN_PATH),
        _value(podenv.RAY_AUTH_MODE, "token"),
        _value(podenv.RAY_AUTH_TOKEN_PATH, RAY_TOKEN_PATH),
    ]
    optional: tuple[tuple[str, str | int | None], ...] = (
        (podenv.RAY_NUM_CPUS, ray.num_cpus),
        (podenv.RAY_NUM_GPUS, ray.num_gpus),
        (podenv.RAY_OBJECT_STORE_BYTES, ray.object_store_memory_bytes),
        (podenv.RAY_VERSION, ray.version),
        (podenv.RAY_DASHBOARD, 1 if ray.dashboard else None),
    )
    env += [_value(name, value) for name, value in optional if value is not None]
    return env
