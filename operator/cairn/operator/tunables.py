"""The operator's tunables, in one object instead of module globals.

``DEFAULT`` is what the operator runs with; a test or an embedding builds its
own ``Settings`` and passes the part a function needs (``s3store`` takes
``S3``, the S3 daemon in ``handlers`` reads ``storage``). Who may reach which
store (the endpoint allow-list, the operator's own identity) is not a tunable
and lives with the prefix claim (``prefixclaim.Settings``). Pure.
"""

import dataclasses


def _positive(owner: object, *names: str) -> None:
    for name in names:
        if getattr(owner, name) <= 0:
            raise ValueError(f"{type(owner).__name__}.{name} must be > 0")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class S3:
    """Bounds of every S3 call the operator makes (``s3store``)."""

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
    """Full-object CRC32Cs remembered per (key, ETag) before the cache starts over."""

    def __post_init__(self) -> None:
        _positive(
            self,
            "max_attempts",
            "connect_timeout_seconds",
            "read_timeout_seconds",
            "delete_batch",
            "manifest_max_bytes",
            "head_cache_entries",
        )
        if self.delete_batch > 1000:
            raise ValueError("S3.delete_batch must be <= 1000 (DeleteObjects' limit)")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StorageLoop:
    """When the per-job S3 pass runs and how ``onDelete: Delete`` retries."""

    interval_seconds: float = 30.0
    """Between two passes of one job, unless a new upload kicks it earlier."""
    initial_delay_seconds: float = 2.0
    threads: int = 4
    """Worker threads for boto3, apart from the reconcile loops' threads."""
    cleanup_attempts: int = 5
    """Failed ``onDelete: Delete`` attempts before ``CleanupFailed`` releases the job."""
    cleanup_backoff_seconds: float = 2.0
    """First delay between cleanup attempts; doubles after each (2, 4, 8, 16 s)."""

    def __post_init__(self) -> None:
        _positive(
            self,
            "interval_seconds",
            "threads",
            "cleanup_attempts",
            "cleanup_backoff_seconds",
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    s3: S3 = dataclasses.field(default_factory=S3)
    storage: StorageLoop = dataclasses.field(default_factory=StorageLoop)


DEFAULT = Settings()
