"""`checkpoint.upload.intervalSteps` from the spec to the trainer's options.

Covers: the pod env has `CAIRN_UPLOAD_INTERVAL_STEPS` exactly when the field
is set; the trainer's runtime config parses it back into
`CheckpointOptions.upload_interval_steps`, and ignores it without an upload
URI (nothing is uploaded, so nothing is thinned).
"""

from cairn.api import podenv
from cairn.checkpoint import runtime_config
from cairn.operator.core import decisions, envvars

from . import jobs

UPLOAD = {"uri": "s3://bucket/jobs/demo"}


def _env(**checkpoint: object) -> dict[str, str]:
    job = jobs.job(checkpoint=checkpoint)
    target = decisions.resume_target(job)
    env = {
        e["name"]: str(e.get("value", ""))
        for e in envvars.pod_env(job, attempt=0, rank=0, resume=target)
    }
    del env[podenv.MANIFEST_KEYRING]  # a file of the job's Secret, mounted in pods only
    return env


def test_the_interval_reaches_the_trainers_options() -> None:
    env = _env(intervalSteps=1, upload={**UPLOAD, "intervalSteps": 10})
    assert env[podenv.UPLOAD_INTERVAL_STEPS] == "10"
    opts = runtime_config.from_env(env).checkpoint
    assert opts.interval_steps == 1 and opts.upload_interval_steps == 10


def test_unset_uploads_every_save() -> None:
    env = _env(intervalSteps=5, upload=UPLOAD)
    assert podenv.UPLOAD_INTERVAL_STEPS not in env
    assert runtime_config.from_env(env).checkpoint.upload_interval_steps is None


def test_without_an_upload_uri_the_interval_is_ignored() -> None:
    env = {podenv.UPLOAD_INTERVAL_STEPS: "10", podenv.CHECKPOINT_INTERVAL_STEPS: "1"}
    assert runtime_config.from_env(env).checkpoint.upload_interval_steps is None
