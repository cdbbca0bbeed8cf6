"""The pod contract: environment variables the operator sets in every rank's pod.

Pure. The operator's builders write these names (``cairn.operator.core.builders``);
the trainer image reads them (its launcher and checkpoint writer). Both sides
import this one module, so a rename breaks both at once instead of silently.

The trainer container runs the user's ``command``/``args`` verbatim. The
``PET_*`` variables are torchrun's own defaults for its flags (``--nnodes``,
``--nproc-per-node``, ``--node-rank``, ``--master-addr``, ``--master-port``,
``--max-restarts``), so ``torchrun script.py`` needs no flags. For a plain
``python`` command with one process per node, the ``env://`` variables
(``MASTER_ADDR``, ``WORLD_SIZE``, ``RANK``…) are set as well.
"""

import dataclasses
import re
from typing import Literal

# --- identity ------------------------------------------------------------
JOB_NAME = "CAIRN_JOB_NAME"
NAMESPACE = "CAIRN_NAMESPACE"
JOB_UID = "CAIRN_JOB_UID"
ATTEMPT = "CAIRN_ATTEMPT"
"""1-based attempt number; a new attempt starts after every gang restart or resume."""
POD_NAME = "CAIRN_POD_NAME"
POD_UID = "CAIRN_POD_UID"
"""The pod's UID (downward API): a pod replaced in place has a new one, so
its ranks are new members of the torchrun worker group."""
NODE_RANK = "CAIRN_NODE_RANK"
NNODES = "CAIRN_NNODES"
NPROC_PER_NODE = "CAIRN_NPROC_PER_NODE"
MASTER_ADDR_CAIRN = "CAIRN_MASTER_ADDR"
MASTER_PORT_CAIRN = "CAIRN_MASTER_PORT"

# --- checkpointing -----------------------------------------------------------
CHECKPOINT_DIR = "CAIRN_CHECKPOINT_DIR"
CHECKPOINT_INTERVAL_STEPS = "CAIRN_CHECKPOINT_INTERVAL_STEPS"
CHECKPOINT_INTERVAL_SECONDS = "CAIRN_CHECKPOINT_INTERVAL_SECONDS"
ASYNC_MODE = "CAIRN_ASYNC_MODE"
KEEP_LAST = "CAIRN_KEEP_LAST"
MAX_BYTES = "CAIRN_MAX_BYTES"
FINAL_CHECKPOINT_GRACE_SECONDS = "CAIRN_FINAL_CHECKPOINT_GRACE_SECONDS"
"""The pod's termination grace period: the budget for the SIGTERM checkpoint."""
MANIFEST_KEYRING = "CAIRN_MANIFEST_KEYRING"
"""Path of the job's manifest keyring file (the per-job Secret, mounted read-only
at ``MANIFEST_KEY_DIR``): rank 0 signs manifests, every rank verifies them."""
MANIFEST_KEY_DIR = "/var/run/cairn/manifest-key"
MANIFEST_KEYRING_FILE = "keyring.json"
"""The Secret's data key, and so the file name under ``MANIFEST_KEY_DIR``."""
RESUME_FROM = "CAIRN_RESUME_FROM"
"""See :func:`format_resume` / :func:`parse_resume`."""
RESUME_SHA256 = "CAIRN_RESUME_SHA256"
"""``checkpoint.resume.sha256``: the SHA-256 the target's ``.metadata`` must have
(set only with a step or uri target; ``ResumeTarget.sha256``)."""
MEMORY_DIR = "CAIRN_MEMORY_DIR"
"""``checkpoint.memory.enabled``: where the memory-backed emptyDir is mounted
(the in-memory tier, ``cairn.checkpoint.memtier``); unset: the tier is off."""
MEMORY_REPLICAS = "CAIRN_MEMORY_REPLICAS"
"""``checkpoint.memory.replicas``: 1 pushes each rank's copy to rank r+1's memory."""
MEMORY_MOUNT_PATH = "/var/run/cairn/memory"
MEMORY_VOLUME_NAME = "cairn-memory"

# --- S3 durable tier ---------------------------------------------------------
UPLOAD_URI = "CAIRN_UPLOAD_URI"
UPLOAD_CONCURRENCY = "CAIRN_UPLOAD_CONCURRENCY"
UPLOAD_ON_FAILURE = "CAIRN_UPLOAD_ON_FAILURE"
"""``Continue`` (keep training, upload later) or ``Fail``: ``checkpoint.upload.onFailure``."""
UPLOAD_STALL_SECONDS = "CAIRN_UPLOAD_STALL_SECONDS"
"""``checkpoint.upload.stallSeconds``: a transfer without progress this long is cancelled."""
UPLOAD_INTERVAL_STEPS = "CAIRN_UPLOAD_INTERVAL_STEPS"
"""``checkpoint.upload.intervalSteps``: only saves of steps divisible by it are uploaded."""
AWS_ENDPOINT_URL_S3 = "AWS_ENDPOINT_URL_S3"
AWS_REGION = "AWS_REGION"
AWS_ACCESS_KEY_ID = "AWS_ACCESS_KEY_ID"
AWS_SECRET_ACCESS_KEY = "AWS_SECRET_ACCESS_KEY"

# --- status reporting (rank 0's writer -> TrainingJob /status) -------------
REPORT_STATUS = "CAIRN_REPORT_STATUS"
""""1" when the writer should patch the job's status (the pod has the Role)."""
STATUS_INTERVAL_SECONDS = "CAIRN_STATUS_INTERVAL_SECONDS"
"""``checkpoint.statusIntervalSeconds``: the least time between two step-only reports."""

# --- torchrun / torch.distributed ------------------------------------------
PET_NNODES = "PET_NNODES"
PET_NPROC_PER_NODE = "PET_NPROC_PER_NODE"
PET_NODE_RANK = "PET_NODE_RANK"
PET_MASTER_ADDR = "PET_MASTER_ADDR"
PET_MASTER_PORT = "PET_MASTER_PORT"
PET_MAX_RESTARTS = "PET_MAX_RESTARTS"
PET_RDZV_BACKEND = "PET_RDZV_BACKEND"
PET_RDZV_ENDPOINT = "PET_RDZV_ENDPOINT"
PET_RDZV_ID = "PET_RDZV_ID"
PET_RDZV_CONF = "PET_RDZV_CONF"
TORCH_DISABLE_SHARE_RDZV_TCP_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""1: torchrun's c10d rendezvous gives each round a fresh worker store."""
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
WORLD_SIZE = "WORLD_SIZE"
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"

MASTER_PORT_DEFAULT = 29500

# --- runtime ray (spec.runtime: ray) -------------------------------------------
RUNTIME = "CAIRN_RUNTIME"
"""``torchrun`` or ``ray``: ``spec.runtime``."""
RAY_PORT = "CAIRN_RAY_PORT"
"""The head's GCS port; the head's address is ``CAIRN_MASTER_ADDR``."""
RAY_NUM_CPUS = "CAIRN_RAY_NUM_CPUS"
RAY_NUM_GPUS = "CAIRN_RAY_NUM_GPUS"
RAY_OBJECT_STORE_BYTES = "CAIRN_RAY_OBJECT_STORE_BYTES"
RAY_VERSION = "CAIRN_RAY_VERSION"
"""The ``ray.__version__`` the job needs (``spec.ray.version``); unset: not checked."""
RAY_MAX_INPLACE_RESTARTS = "CAIRN_RAY_MAX_INPLACE_RESTARTS"
RAY_DASHBOARD = "CAIRN_RAY_DASHBOARD"
"""``1`` when ``spec.ray.dashboard`` asks for the dashboard (on the head, bound
to ``CAIRN_POD_IP``); unset: no dashboard."""
RAY_DASHBOARD_PORT = 8265
POD_IP = "CAIRN_POD_IP"
"""The pod's own address (``status.podIP``): the Ray node's ``--node-ip-address``."""
RAY_PORT_DEFAULT = 6379
RAY_TEMP_DIR = "/tmp/ray"
"""Ray's ``--temp-dir``: an emptyDir of the pod's own (short, so Ray's Unix
sockets stay under the 107-byte path limit, and never shared between pods)."""
RAYNODE_MODULE = "cairn.trainer.raynode"
"""``python -m cairn.trainer.raynode -- <command>``: the operator prepends it."""
RAY_TOKEN_FILE = "CAIRN_RAY_TOKEN_FILE"
"""Path of the job's Ray auth token (the ``<job>-ray-token`` Secret, mounted at
``RAY_TOKEN_DIR``): the launcher then runs every Ray process with
``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN_PATH`` naming it."""
RAY_TOKEN_DIR = "/var/run/cairn/ray-token"
RAY_TOKEN_KEY = "token"
"""The Secret's data key, and so the file name under ``RAY_TOKEN_DIR``."""
RAY_AUTH_MODE = "RAY_AUTH_MODE"
RAY_AUTH_TOKEN = "RAY_AUTH_TOKEN"
RAY_AUTH_TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"
"""Ray's own variables (Ray 2.60 token auth): the mode, an inline token (which
Ray prefers to the path, so the launcher removes it) and the token file."""

# --- the resume target ---------------------------------------------------------
ResumeKind = Literal["latest", "none", "step", "uri"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ResumeTarget:
    """What an attempt resumes from, as carried by ``CAIRN_RESUME_FROM``."""

    kind: ResumeKind
    step: int | None = None
    uri: str | None = None
    sha256: str | None = None
    """Pin of the target's ``.metadata`` (``CAIRN_RESUME_SHA256``); step/uri only."""

    def __post_init__(self) -> None:
        if (self.kind == "step") != (self.step is not None):
            raise ValueError("ResumeTarget.step is set exactly when kind is 'step'")
        if (self.kind == "uri") != (self.uri is not None):
            raise ValueError("ResumeTarget.uri is set exactly when kind is 'uri'")
        if self.sha256 is not None and self.kind not in ("step", "uri"):
            raise ValueError("ResumeTarget.sha256 pins a step or uri target only")


def format_resume(target: ResumeTarget) -> str:
    """``latest`` | ``none`` | ``step:<N>`` | ``s3://…``."""
    if target.kind == "step":
        return f"step:{target.step}"
    if target.kind == "uri":
        return str(target.uri)
    return target.kind


def parse_resume(value: str, *, sha256: str | None = None) -> ResumeTarget:
    """Inverse of :func:`format_resume` (``sha256``: ``CAIRN_RESUME_SHA256``, for a
    step or uri target); raises ValueError naming the variable."""
    target = _parse_resume(value)
    if sha256:
        if target.kind not in ("step", "uri") or re.fullmatch(r"[0-9a-f]{64}", sha256) is None:
            raise ValueError(
                f"{RESUME_SHA256}={sha256!r}: expected 64 lowercase hex digits, with a step"
                " or uri target"
            )
        return dataclasses.replace(target, sha256=sha256)
    return target


def _parse_resume(value: str) -> ResumeTarget:
    if value == "latest":
        return ResumeTarget(kind="latest")
    if value == "none":
        return ResumeTarget(kind="none")
    if value.startswith("step:") and value[5:].isdigit():
        return ResumeTarget(kind="step", step=int(value[5:]))
    if value.startswith("s3://"):
        return ResumeTarget(kind="uri", uri=value)
    raise ValueError(f"{RESUME_FROM}={value!r}: expected latest, none, step:<N> or s3://…")
