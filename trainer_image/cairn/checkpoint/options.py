"""Configuration of the checkpoint writer: kw-only slotted dataclasses.

Each field documents itself; `__post_init__` rejects bad combinations with a
message naming the field. The operator renders these from the TrainingJob
spec via the pod's environment, parsed by `cairn.checkpoint.runtime_config`.
"""

from __future__ import annotations

import dataclasses
import pathlib
import typing

from cairn.api import checkpointspec, retention
from cairn.api import manifest as manifest_mod

if typing.TYPE_CHECKING:
    from cairn.checkpoint import fence as fence_mod


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class S3Options:
    """Where and how a rank uploads its files (and downloads them on resume)."""

    uri: str
    """`s3://bucket/prefix`; step folders become `prefix/step-<N>/...`."""
    endpoint_url: str | None = None
    """Custom endpoint (MinIO, SeaweedFS...); None means AWS."""
    region: str | None = None
    access_key: str | None = None
    """None: the standard AWS credential chain (env, profile, IRSA...)."""
    secret_key: str | None = dataclasses.field(default=None, repr=False)
    """Never in the repr (hence not in str(), f-strings, log lines or the repr of
    a `CheckpointOptions` holding these options); `dataclasses.asdict` still
    returns it, as it returns every field: do not log that dict."""
    concurrency: int = 8
    """Parallel part uploads/ranged GETs per rank."""
    part_size: int = 16 * 1024 * 1024
    max_attempts: int = 5
    """Botocore attempts per request (standard retry mode: 5xx, SlowDown, resets)."""
    connect_timeout: float = 5.0
    read_timeout: float = 30.0
    """A request that receives nothing for this long fails (and is retried)."""
    transfer_timeout: float = 600.0
    """Bound on a whole upload/download of a rank's files, however slowly it moves."""
    stall_seconds: float = 30.0
    """A transfer that moves no bytes for this long is cancelled (the progress
    watchdog, `checkpoint.upload.stallSeconds`): a hung store fails in seconds."""

    def __post_init__(self) -> None:
        if not self.uri.startswith("s3://") or len(self.uri) <= len("s3://"):
            raise ValueError(f"S3Options.uri must look like s3://bucket/prefix, got {self.uri!r}")
        if self.concurrency < 1:
            raise ValueError("S3Options.concurrency must be >= 1")
        if self.part_size < 5 * 1024 * 1024:
            raise ValueError("S3Options.part_size must be >= 5 MiB (S3 minimum part size)")
        if self.max_attempts < 1:
            raise ValueError("S3Options.max_attempts must be >= 1")
        if self.stall_seconds <= 0:
            raise ValueError("S3Options.stall_seconds must be > 0")
        if (self.access_key is None) != (self.secret_key is None):
            raise ValueError("S3Options.access_key and secret_key go together")

    @property
    def bucket(self) -> str:
        return checkpointspec.split_s3_uri(self.uri)[0]

    @property
    def prefix(self) -> str:
        """Key prefix without leading or trailing slash ('' for the bucket root)."""
        return checkpointspec.split_s3_uri(self.uri)[1]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointOptions:
    """Everything the `CheckpointManager` needs to know."""

    directory: pathlib.Path
    """Local checkpoint root holding `step-<N>/` folders (shared by all ranks)."""
    interval_steps: int | None = None
    """Save when `step % interval_steps == 0`."""
    interval_seconds: float | None = None
    """Save when this long passed since the last save (rank 0's clock decides)."""
    keep_last: int = 3
    """Committed steps kept locally (>= 2: the newest may still be writing)."""
    max_bytes: int | None = None
    """Local byte budget for kept committed steps (protected steps are always kept)."""
    keep_aside: int = 3
    """Folders kept per kind under `<root>/.cairn/quarantine` and
    `.cairn/superseded` (this job's only; see `aside.plan_prune`)."""
    attempt: int = 0
    """Attempt id of this run (the operator's restart counter); fences commits."""
    group: int = 0
    """Generation of the Ray rank-actor group within the attempt (`status.ray.group`,
    pod env of the rank actors `CAIRN_RAY_GROUP`), or of torchrun's worker group
    (`TORCHELASTIC_RESTART_COUNT`, `status.torchrun.group`). A writer's
    identity is (attempt, group): an in-place restart fences the old group."""
    group_members: str | None = None
    """Runtime torchrun: who runs `group` (`torchrun_group.members`), kept in the
    fence file so the next manager tells this group from a new one."""
    job_uid: str | None = None
    """UID of the TrainingJob (pod env CAIRN_JOB_UID). Recorded in manifests, the
    fence and folder names; steps of another UID are foreign (kept, never
    loaded as "latest"). None (library use): every step under the root is ours."""
    job_namespace: str | None = None
    job_name: str | None = None
    """The TrainingJob's namespace and name (pod env CAIRN_NAMESPACE,
    CAIRN_JOB_NAME): with `job_uid`, the owner record rank 0 creates when the
    upload prefix has none yet (`remote.check_prefix_owner`)."""
    manifest_keyring: manifest_mod.Keyring | None = None
    """The job's manifest keys (the operator's per-job Secret, mounted into the
    rank containers; pod env CAIRN_MANIFEST_KEYRING names the file). Set: rank
    0 signs every manifest with the current key, and only manifests that
    verify with one of the keys are this job's steps. None (library use, a
    bench without signing): manifests are unsigned and judged by `job_uid`
    alone (`cairn.api.manifest.authenticate`)."""
    fence: fence_mod.Fence | None = None
    """An extra authority checked by rank 0 before each commit (the API server's
    view of the job, `fence.ApiFence`); the local fence file is always checked."""
    s3: S3Options | None = None
    async_mode: checkpointspec.AsyncMode = "pinned"
    """`pinned`: save() returns once staging started; the state is copied into
    reusable pinned host buffers (page-locked on CUDA; plain memory on CPU,
    where pinning does not exist) by a staging thread. `thread`: the same
    with pageable host buffers. `off`: synchronous, save() returns after the
    local commit (no staging copy: DCP reads the live tensors, like
    `dcp.save`); upload and rotation still run in the writer thread."""
    upload_on_failure: checkpointspec.UploadOnFailure = "Continue"
    """What a failed upload does. `Continue`: training goes on, the step stays
    committed locally and in the upload backlog, retried at later saves
    (with backoff) and at start-up, and reported (`uploadError`). `Fail`:
    the next call on the manager raises."""
    upload_retry_seconds: float = 2.0
    """Wait before retrying a failed upload round; doubles per failed round,
    up to `upload_backlog.MAX_BACKOFF_FACTOR` times this."""
    final_grace_seconds: float | None = None
    """The pod's termination grace: the SIGTERM checkpoint must commit within
    it (minus `FINAL_MARGIN_SECONDS`); None: `timeout_seconds` bounds it."""
    write_threads: int = 2
    """DCP writer threads per rank (one file each). Two measured 1.6x faster
    than one here: torch.save's serialization is CPU-bound per thread."""
    timeout_seconds: float = 600.0
    """Bound on every wait for another rank (store waits, checkpoint collectives)."""
    memory_dir: pathlib.Path | None = None
    """The in-memory tier's folder (a memory-backed emptyDir, pod env
    CAIRN_MEMORY_DIR; `cairn.checkpoint.memtier`): each rank keeps its newest
    committed files there, and restore tries it first. None: the tier is off."""
    memory_replicas: int = 1
    """With `memory_dir`: 1 also pushes each rank's copy to its successor's
    replica server (rank r+S mod N, S the ranks per pod, so another pod's:
    `memtier.successor`, `cairn.checkpoint.peer`); 0: own memory only."""
    upload_interval_steps: int | None = None
    """With `s3`: upload only the saves of steps divisible by this (and the
    final and last saves, `cairn.checkpoint.tiers`); the others stay on the
    volume and in memory, marked local-only, and rotate without an upload.
    A multiple of `interval_steps` (refused otherwise, and with saves by time).
    None: every committed step is uploaded."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "directory", pathlib.Path(self.directory))
        if self.interval_steps is not None and self.interval_steps < 1:
            raise ValueError("CheckpointOptions.interval_steps must be >= 1 or None")
        if self.interval_seconds is not None and self.interval_seconds <= 0:
            raise ValueError("CheckpointOptions.interval_seconds must be > 0 or None")
        if self.keep_last < retention.MIN_LOCAL_KEEP_LAST:
            raise ValueError(
                f"CheckpointOptions.keep_last must be >= {retention.MIN_LOCAL_KEEP_LAST}"
            )
        if self.keep_aside < 1:
            raise ValueError("CheckpointOptions.keep_aside must be >= 1")
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise ValueError("CheckpointOptions.max_bytes must be > 0 or None")
        if self.attempt < 0:
            raise ValueError("CheckpointOptions.attempt must be >= 0")
        if self.group < 0:
            raise ValueError("CheckpointOptions.group must be >= 0")
        if self.upload_interval_steps is not None:
            # It picks saves by step number: a multiple of the save interval, which
            # must be in steps (with interval_seconds most steps would never match).
            every, saves = self.upload_interval_steps, self.interval_steps
            if every < 1 or saves is None or every % saves:
                raise ValueError(
                    "CheckpointOptions.upload_interval_steps must be a multiple of "
                    f"interval_steps (got {every}, interval_steps {saves})"
                )
        if self.write_threads < 1:
            raise ValueError("CheckpointOptions.write_threads must be >= 1")
        if self.timeout_seconds <= 0:
            raise ValueError("CheckpointOptions.timeout_seconds must be > 0")
        if self.async_mode not in typing.get_args(checkpointspec.AsyncMode):
            raise ValueError(
                f"CheckpointOptions.async_mode must be one of "
                f"{typing.get_args(checkpointspec.AsyncMode)}, got {self.async_mode!r}"
            )
        if self.upload_on_failure not in typing.get_args(checkpointspec.UploadOnFailure):
            raise ValueError(
                f"CheckpointOptions.upload_on_failure must be one of "
                f"{typing.get_args(checkpointspec.UploadOnFailure)}, got {self.upload_on_failure!r}"
            )
        if self.upload_retry_seconds <= 0:
            raise ValueError("CheckpointOptions.upload_retry_seconds must be > 0")
        if self.memory_dir is not None:
            object.__setattr__(self, "memory_dir", pathlib.Path(self.memory_dir))
        if self.memory_replicas not in (0, 1):
            raise ValueError("CheckpointOptions.memory_replicas must be 0 or 1")
        if self.final_grace_seconds is not None and self.final_grace_seconds <= 0:
            raise ValueError("CheckpointOptions.final_grace_seconds must be > 0 or None")
