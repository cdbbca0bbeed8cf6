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
    manifest_max_bytes: int = 2 * 1024 * 1024
    """A manifest object larger than this is refused unread (its listed size) or, if it
    grew after the listing, after reading this many bytes plus one: never read whole.
    Reading and parsing cost up to ~15x its bytes (measured), so this bounds one
    pass's manifest memory (~30 MiB)."""
    manifest_max_entries: int = 16384
    """A manifest listing more files than this is refused (each costs a HEAD per pass)."""
    list_max_keys: int = 20000
    """Objects one pass lists under a prefix; past it the pass stops (``lastError``),
    deletes nothing and verifies nothing (~250 bytes of operator memory per key)."""
    list_page_keys: int = 1000
    """``MaxKeys`` of each ListObjectsV2 page (S3 answers at most 1,000)."""
    list_pages_per_pass: int = 2
    """ListObjectsV2 pages (up to 1,000 keys each) one pass lists; a longer listing goes
    on in the job's next passes, each re-queued behind the passes already due
    (``core.s3slice``), so a tenant's big prefix never holds a thread for long."""
    list_held_keys: int = 100000
    """Objects all listings in progress may hold between passes together (~250 bytes
    each: ~25 MiB); past it a listing goes on in the pass it is in, as a whole
    listing did before slices, so memory stays bounded by the S3 threads."""
    head_cache_entries: int = 20000
    """Full-object CRC32Cs remembered per job, per (key, ETag), before the cache starts over."""
    manifest_cache_entries: int = 2000
    """Step verdicts remembered per job, per (manifest ETag, the step's listing): an
    unchanged step is judged once. Verdicts, never parsed manifests, are kept."""
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
            "manifest_max_entries",
            "list_max_keys",
            "list_page_keys",
            "list_pages_per_pass",
            "list_held_keys",
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
    pass_deadline_seconds: float = 120.0
    """One job's pass stops starting S3 calls past this (``lastError`` says so); a pass
    still running at it is reported abandoned (one call is bounded by ``S3``'s timeouts)."""
    slow_after_seconds: float = 10.0
    """A pass running this long marks its endpoint slow (``core.s3fair``): a slow or not
    yet proven endpoint gets one pass at a time, and all of them together ``slow_share``."""
    slow_share: float = 0.5
    """Fraction of ``threads`` (at least one, never all but where ``threads`` is 1) that
    slow and unproven endpoints may hold at once: the rest always serve healthy ones."""
    list_cap_backoff_seconds: float = 60.0
    """After a listing reached ``S3.list_max_keys``: the wait before the job's next full
    listing; it doubles with each such listing in a row (``core.s3slice.cap_backoff``)."""
    list_cap_backoff_cap_seconds: float = 3600.0
    """No wait after a capped listing exceeds this."""
    cleanup_attempts: int = 5
    """Failed ``onDelete: Delete`` attempts before ``CleanupFailed`` releases the job."""
    cleanup_backoff_seconds: float = 2.0
    """First delay between cleanup attempts; doubles after each (about 2, 4, 8,
    16 s, each less up to half at random: ``core.backoff``)."""
    cleanup_backoff_cap_seconds: float = 60.0
    """No delay between two cleanup attempts exceeds this."""

    def __post_init__(self) -> None:
        _positive(
            self,
            "interval_seconds",
            "initial_delay_seconds",
            "kick_delay_seconds",
            "threads",
            "pass_deadline_seconds",
            "slow_after_seconds",
            "list_cap_backoff_seconds",
            "list_cap_backoff_cap_seconds",
            "cleanup_attempts",
            "cleanup_backoff_seconds",
            "cleanup_backoff_cap_seconds",
        )
        if self.cleanup_backoff_cap_seconds < self.cleanup_backoff_seconds:
            raise ValueError(
                "StorageLoop.cleanup_backoff_cap_seconds must be >= cleanup_backoff_seconds"
            )
        if self.list_cap_backoff_cap_seconds < self.list_cap_backoff_seconds:
            raise ValueError(
                "StorageLoop.list_cap_backoff_cap_seconds must be >= list_cap_backoff_seconds"
            )
        if not 0 < self.slow_share <= 1:
            raise ValueError("StorageLoop.slow_share must be in (0, 1]")


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
    """After a reconcile that failed with an API or transport error: the first
    delay of the job's own jittered backoff (``core.backoff``)."""
    error_backoff_cap_seconds: float = 60.0
    """The reconcile backoff doubles per consecutive failure up to this."""
    error_jitter: float = 0.5
    """Fraction of each reconcile retry delay drawn at random, so every job's
    daemon does not come back at the same moment after an API server outage."""
    retry_after_cap_seconds: float = 120.0
    """The API server's ``Retry-After`` (429/503) is honoured up to this."""
    stop_timeout_seconds: float = 10.0
    """A stopped loop (the job finished, the operator stops) may finish the
    reconcile it is in for this long before it is cancelled."""
    pod_gone_margin_seconds: float = 30.0
    """``onDelete: Delete`` waits for the pods' grace period plus this, then cleans anyway."""
    pod_gone_poll_seconds: float = 1.0
    api_threads: int = 16
    """Worker threads (and pooled connections) for the Kubernetes client calls of
    every job's reconcile: they mostly wait on the API server."""
    api_connect_timeout_seconds: float = 10.0
    api_read_timeout_seconds: float = 60.0
    """Every API call the operator makes through ``kubeapi`` without its own
    ``_request_timeout`` gets these: a frozen or half-open API server
    connection fails the call (then the reconcile backs off) instead of
    holding one of ``api_threads`` for ever. The read timeout bounds the wait
    between bytes, not a long list's total time."""

    def __post_init__(self) -> None:
        _positive(
            self,
            "api_threads",
            "api_connect_timeout_seconds",
            "api_read_timeout_seconds",
            "resync_seconds",
            "min_requeue_seconds",
            "expectation_seconds",
            "error_retry_seconds",
            "error_backoff_cap_seconds",
            "retry_after_cap_seconds",
            "stop_timeout_seconds",
            "pod_gone_margin_seconds",
            "pod_gone_poll_seconds",
        )
        if not 0 <= self.resync_jitter < 1:
            raise ValueError("Reconcile.resync_jitter must be in [0, 1)")
        if not 0 <= self.error_jitter <= 1:
            raise ValueError("Reconcile.error_jitter must be in [0, 1]")
        if self.error_backoff_cap_seconds < self.error_retry_seconds:
            raise ValueError("Reconcile.error_backoff_cap_seconds must be >= error_retry_seconds")


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
