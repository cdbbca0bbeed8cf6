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
from collections.abc import Mapping

from cairn.api import podenv
from cairn.checkpoint import options


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


def from_env(
    environ: Mapping[str, str] | None = None, *, default_dir: pathlib.Path | None = None
) -> RuntimeConfig:
    """Parse the pod's environment (defaults: `os.environ`, a local `./checkpoints`)."""
    env = os.environ if environ is None else environ
    s3 = None
    if env.get(podenv.UPLOAD_URI):
        s3 = options.S3Options(
            uri=env[podenv.UPLOAD_URI],
            endpoint_url=env.get(podenv.AWS_ENDPOINT_URL_S3) or None,
            region=env.get(podenv.AWS_REGION) or None,
            concurrency=_int(env, podenv.UPLOAD_CONCURRENCY, 8) or 8,
        )
    attempt = _int(env, podenv.ATTEMPT, 0) or 0
    directory = env.get(podenv.CHECKPOINT_DIR) or str(default_dir or pathlib.Path("checkpoints"))
    keep_last = _int(env, podenv.KEEP_LAST, 3)
    checkpoint = options.CheckpointOptions(
        directory=pathlib.Path(directory),
        interval_steps=_int(env, podenv.CHECKPOINT_INTERVAL_STEPS),
        interval_seconds=_float(env, podenv.CHECKPOINT_INTERVAL_SECONDS),
        keep_last=3 if keep_last is None else keep_last,
        max_bytes=_int(env, podenv.MAX_BYTES),
        attempt=attempt,
        s3=s3,
    )
    return RuntimeConfig(
        job_name=env.get(podenv.JOB_NAME) or None,
        namespace=env.get(podenv.NAMESPACE) or None,
        attempt=attempt,
        node_rank=_int(env, podenv.NODE_RANK, 0) or 0,
        checkpoint=checkpoint,
        resume=podenv.parse_resume(env.get(podenv.RESUME_FROM) or "latest"),
        report_status=env.get(podenv.REPORT_STATUS) == "1",
        final_checkpoint_grace_seconds=_float(env, podenv.FINAL_CHECKPOINT_GRACE_SECONDS),
    )
