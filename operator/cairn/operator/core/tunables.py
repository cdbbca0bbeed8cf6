"""The operator's tunables, in one object instead of module globals.

``DEFAULT`` is what the operator runs with; a test or an embedding builds its
own ``Settings`` and passes the part a function needs (``s3observe`` takes
``S3``, the S3 loop in ``handlers`` reads ``storage``, the reconcile loop
``reconcile``, ``lifecycle`` its requeue delays from ``lifecycle``). Who may reach which
store (the endpoint allow-list, the operator's own identity) is not a tunable
and lives with the prefix claim (``prefixplan.Settings``). Pure.
"""

import dataclasses


def _positive(owner: object, *names: str) -> None:
    for name in names:
        if getattr(owner, name) <= 0:
            raise ValueError(f"{type(owner).__name__}.{name} must be > 0")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class S3:
    """Bounds of every S3 call the operator makes (``s3observe``, ``s3apply``)."""

    default_region: str = "us-east-1"
    """Region of a client whose upload spec names none."""
    max_attempts: int = 4
    """botocore's standard-mode ``max_attempts``: retries after the first call."""
    connect_timeout_seconds: float = 5.0
    read_timeout_seconds: float = 20.0
    delete_batch: int = 1000
    """Keys per DeleteObjects call (S3's own limit is 1000)."""
    manifest_max_bytes: int = 16 * 1024 * 1024
    """A manifest object larger than this is read truncated and fails to parse."""
    head_cache_entries: int = 20000
    """Full-object CRC32Cs remembered per job, per (key, ETag), before the cache starts over."""
    manifest_cache_entries: int = 2000
    """Parsed manifests remembered per job, per (key, ETag): an unchanged one is read once."""
    client_cache_entries: int = 64
    """S3 clients kept per (endpoint, region, key pair), least recently used dropped."""

    def __post_init__(self) -> None:
        _positive(
            self,
            "max_attempts",
            "connect_timeout_seconds",
            "read_timeout_seconds",
            "delete_batch",
            "manifest_max_bytes",
            "head_cache_entries",
            "manifest_cache_entries",
            "client_cache_entries",
        )
        if self.delete_batch > 1000:
            raise ValueError("S3.delete_batch must be <= 1000 (DeleteObjects' limit)")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StorageLoop:
    """When the S3 pass of a job runs and how ``onDelete: Delete`` retries."""

    interval_seconds: float = 30.0
    """Between two passes of one live job, unless a new upload kicks it earlier."""
    initial_delay_seconds: float = 2.0
    """From the first sight of a job (or an operator start) to its first pass."""
    kick_delay_seconds: float = 1.0
    """From a newly reported ``lastUploaded`` step to the pass that verifies it."""
    threads: int = 4
    """Worker threads for boto3 (passes at once), apart from the reconcile loops' threads."""
    cleanup_attempts: int = 5
    """Failed ``onDelete: Delete`` attempts before ``CleanupFailed`` releases the job."""
    cleanup_backoff_seconds: float = 2.0
    """First delay between cleanup attempts; doubles after each (2, 4, 8, 16 s)."""

    def __post_init__(self) -> None:
        _positive(
            self,
            "interval_seconds",
            "initial_delay_seconds",
            "kick_delay_seconds",
            "threads",
            "cleanup_attempts",
            "cleanup_backoff_seconds",
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Reconcile:
    """The reconcile loop of a live job (``handlers``)."""

    resync_seconds: float = 60.0
    """Longest sleep between two reconciles of a live job (planned from the pod cache)."""
    resync_jitter: float = 0.1
    """Each resync is shortened by up to this fraction, at random, so jobs seen at
    the same moment (an operator start) do not all reconcile at once."""
    min_requeue_seconds: float = 0.5
    expectation_seconds: float = 5.0
    """Longest wait for the pods a reconcile created to show in the watch before
    the next plan (then it plans from the pod cache as it is)."""
    error_retry_seconds: float = 5.0
    """After a reconcile that failed with an API error."""
    stop_timeout_seconds: float = 10.0
    """A stopped loop (the job finished, the operator stops) may finish the
    reconcile it is in for this long before it is cancelled."""
    pod_gone_margin_seconds: float = 30.0
    """``onDelete: Delete`` waits for the pods' grace period plus this, then cleans anyway."""
    pod_gone_poll_seconds: float = 1.0
    api_threads: int = 16
    """Worker threads (and pooled connections) for the Kubernetes client calls of
    every job's reconcile: they mostly wait on the API server."""

    def __post_init__(self) -> None:
        _positive(
            self,
            "api_threads",
            "resync_seconds",
            "min_requeue_seconds",
            "expectation_seconds",
            "error_retry_seconds",
            "stop_timeout_seconds",
            "pod_gone_margin_seconds",
            "pod_gone_poll_seconds",
        )
        if not 0 <= self.resync_jitter < 1:
            raise ValueError("Reconcile.resync_jitter must be in [0, 1)")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Lifecycle:
    """Delays the pure ``lifecycle`` decisions ask for (``requeue_after``)."""

    suspend_requeue_seconds: float = 10.0
    """Look again while pods terminate (suspend, stop, cleanup)."""
    create_error_requeue_seconds: float = 10.0
    """Retry of a refused create (quota, admission, a name conflict the user may fix)."""
    stale_status_requeue_seconds: float = 2.0
    """Pods newer than the job's recorded attempt: our own patch is not visible yet."""
    default_stale_seconds: int = 3600
    """``CheckpointStale`` after this long without a commit, when no interval in seconds is set."""
    stale_slack_seconds: int = 300
    """Added to twice ``intervalSeconds`` before a checkpoint counts as stale."""

    def __post_init__(self) -> None:
        _positive(
            self,
            "suspend_requeue_seconds",
            "create_error_requeue_seconds",
            "stale_status_requeue_seconds",
            "default_stale_seconds",
            "stale_slack_seconds",
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    s3: S3 = dataclasses.field(default_factory=S3)
    storage: StorageLoop = dataclasses.field(default_factory=StorageLoop)
    reconcile: Reconcile = dataclasses.field(default_factory=Reconcile)
    lifecycle: Lifecycle = dataclasses.field(default_factory=Lifecycle)


DEFAULT = Settings()
