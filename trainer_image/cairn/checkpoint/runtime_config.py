"""The pod contract, parsed in one place into a typed config.

The operator writes the environment variables named in `cairn.api.podenv`;
this module is the only reader on the trainer side. It yields the writer's
`CheckpointOptions`, the resume target, and where to report status, with a
`ValueError` naming the variable when a value is malformed. A test feeds the
env the operator's builders produce into `from_env`, so the sides cannot
drift.
"""

import dataclasses
import os
import pathlib
import typing
from collections.abc import Mapping

from cairn.api import checkpointspec, podenv
from cairn.api import manifest as manifest_mod
from cairn.checkpoint import foreign, monitor, options, torchrun_group


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeConfig:
    job_name: str | None
    namespace: str | None
    attempt: int
    node_rank: int
    checkpoint: options.CheckpointOptions
    resume: podenv.ResumeTarget
    report_status: bool
    final_checkpoint_grace_seconds: float | None
    status_interval_seconds: float = 30.0
    """Least time between two step-only status reports (`CAIRN_STATUS_INTERVAL_SECONDS`)."""
    import_keys: foreign.KeyMap | None = None
    """User mapping for imports of foreign checkpoints (`CAIRN_IMPORT_KEYS`,
    JSON; docs/checkpointing.md); None: the documented rule decides."""


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    raw = env.get(name, "")
    if raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer") from None


def _float(env: Mapping[str, str], name: str) -> float | None:
    raw = env.get(name, "")
    if raw == "":
        return None
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number") from None


def _keyring(env: Mapping[str, str]) -> manifest_mod.Keyring | None:
    """The job's manifest keyring from the file `CAIRN_MANIFEST_KEYRING` names.

    Unset: no key (unsigned manifests, judged by job UID). Set but unreadable
    or malformed: a ValueError naming the variable (never the key bytes), so
    a pod whose key did not mount fails at start instead of writing steps
    that no later attempt would accept."""
    path = env.get(podenv.MANIFEST_KEYRING, "")
    if path == "":
        return None
    try:
        return manifest_mod.parse_keyring(pathlib.Path(path).read_bytes())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{podenv.MANIFEST_KEYRING}={path!r}: {exc}") from None


_T = typing.TypeVar("_T", bound=str)


def _choice(env: Mapping[str, str], name: str, choices: typing.Any, default: _T) -> _T:
    raw = env.get(name, "")
    if raw == "":
        return default
    allowed = typing.get_args(choices)
    if raw not in allowed:
        raise ValueError(f"{name}={raw!r}: expected one of {', '.join(allowed)}")
    return typing.cast(_T, raw)


def check_launch(env: Mapping[str, str]) -> None:
    """Refuse a torchrun-runtime process that no launcher started although the
    job runs several processes per pod: such a process takes itself for rank 0
    of WORLD_SIZE and would wait forever for ranks nobody starts (a hang, not
    an error). torchrun (or any launcher) sets LOCAL_RANK for each process."""
    procs = _int(env, podenv.NPROC_PER_NODE, 1) or 1
    runtime = env.get(podenv.RUNTIME) or "torchrun"
    if runtime == "torchrun" and procs > 1 and podenv.LOCAL_RANK not in env:
        raise ValueError(
            f"procsPerNode is {procs} but this process was not started by a launcher "
            "(LOCAL_RANK is unset), so it cannot join its job's ranks: make the job's command "
            "`torchrun -m your.module` (or `torchrun train.py`; torchrun takes its flags from "
            "the PET_* variables), or set procsPerNode: 1"
        )


def _group(env: Mapping[str, str]) -> int:
    """The writer's group: the Ray rank-actor group, else torchrun's worker group."""
    if env.get(monitor.GROUP_ENV):
        return _int(env, monitor.GROUP_ENV, 0) or 0
    return torchrun_group.group_from_env(env)


def from_env(
    environ: Mapping[str, str] | None = None, *, default_dir: pathlib.Path | None = None
) -> RuntimeConfig:
    """Parse the pod's environment (defaults: `os.environ`, a local `./checkpoints`)."""
    env = os.environ if environ is None else environ
    check_launch(env)
    s3 = None
    if env.get(podenv.UPLOAD_URI):
        s3 = options.S3Options(
            uri=env[podenv.UPLOAD_URI],
            endpoint_url=env.get(podenv.AWS_ENDPOINT_URL_S3) or None,
            region=env.get(podenv.AWS_REGION) or None,
            concurrency=_int(env, podenv.UPLOAD_CONCURRENCY, 8) or 8,
            stall_seconds=_float(env, podenv.UPLOAD_STALL_SECONDS) or 30.0,
        )
    attempt = _int(env, podenv.ATTEMPT, 0) or 0
    directory = env.get(podenv.CHECKPOINT_DIR) or str(default_dir or pathlib.Path("checkpoints"))
    keep_last = _int(env, podenv.KEEP_LAST, 3)
    grace = _float(env, podenv.FINAL_CHECKPOINT_GRACE_SECONDS)
    checkpoint = options.CheckpointOptions(
        directory=pathlib.Path(directory),
        interval_steps=_int(env, podenv.CHECKPOINT_INTERVAL_STEPS),
        interval_seconds=_float(env, podenv.CHECKPOINT_INTERVAL_SECONDS),
        keep_last=3 if keep_last is None else keep_last,
        max_bytes=_int(env, podenv.MAX_BYTES),
        attempt=attempt,
        group=_group(env),
        job_uid=env.get(podenv.JOB_UID) or None,
        job_namespace=env.get(podenv.NAMESPACE) or None,
        job_name=env.get(podenv.JOB_NAME) or None,
        manifest_keyring=_keyring(env),
        s3=s3,
        async_mode=_choice(env, podenv.ASYNC_MODE, checkpointspec.AsyncMode, "pinned"),
        upload_on_failure=_choice(
            env, podenv.UPLOAD_ON_FAILURE, checkpointspec.UploadOnFailure, "Continue"
        ),
        final_grace_seconds=grace,
        memory_dir=pathlib.Path(env[podenv.MEMORY_DIR]) if env.get(podenv.MEMORY_DIR) else None,
        memory_replicas=_int(env, podenv.MEMORY_REPLICAS, 1) or 0,
        upload_interval_steps=_int(env, podenv.UPLOAD_INTERVAL_STEPS) if s3 else None,
    )
    return RuntimeConfig(
        job_name=env.get(podenv.JOB_NAME) or None,
        namespace=env.get(podenv.NAMESPACE) or None,
        attempt=attempt,
        node_rank=_int(env, podenv.NODE_RANK, 0) or 0,
        checkpoint=checkpoint,
        resume=podenv.parse_resume(
            env.get(podenv.RESUME_FROM) or "latest", sha256=env.get(podenv.RESUME_SHA256)
        ),
        report_status=env.get(podenv.REPORT_STATUS) == "1",
        final_checkpoint_grace_seconds=grace,
        status_interval_seconds=_float(env, podenv.STATUS_INTERVAL_SECONDS) or 30.0,
        import_keys=(
            foreign.parse_key_map(env[foreign.KEY_MAP_ENV])
            if env.get(foreign.KEY_MAP_ENV)
            else None
        ),
    )
