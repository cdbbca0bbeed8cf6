"""End to end: an unloadable resume target fails the job at once, with the reason.

The real operator, real pods (the node agent runs them as local processes),
the reference trainer and the real S3 server: a TrainingJob whose
`spec.checkpoint.resume.uri` points at objects that are no checkpoint (no
Cairn manifest, no DCP `.metadata`) ends Failed with reason
ConfigurationError and the trainer's own reason in `status.lastFailure` and
the Failed condition; no restart is spent on it and nothing is checkpointed.
One whose `.metadata` is a pickle payload (it would create a marker file on
this host, where the pods run) ends Failed the same way, the refused class
named in the reason, and the payload never ran.
Prints `E2E-NUMBERS` (create -> Failed seconds) for the closing report.
"""

import json
import os
import pathlib
import pickle
import time
from typing import Any

import pytest

from tests import demo

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.timeout(600)]


def test_garbage_resume_uri_fails_the_job_at_once_with_the_reason_in_status(
    devcluster: Any, space: tuple[str, str]
) -> None:
    namespace, bucket = space
    s3 = devcluster.target.s3_client()
    s3.put_object(Bucket=bucket, Key="garbage/readme.txt", Body=b"not a checkpoint")
    body = demo.quickstart_manifest(devcluster.target, name="badimport")
    ckpt = body["spec"]["checkpoint"]
    ckpt["upload"]["uri"] = f"s3://{bucket}/badimport"
    ckpt["resume"] = {"uri": f"s3://{bucket}/garbage"}
    body["spec"]["restartPolicy"] = {"maxRestarts": 3, "backoffSeconds": 1}
    started = time.monotonic()
    rows: list[demo.Row] = []
    job = demo.run_job(
        api_client=devcluster.api_client,
        namespace=namespace,
        body=body,
        kill_rank_after_commit=None,
        on_row=rows.append,
        timeout=300,
    )
    seconds = time.monotonic() - started
    print(f"E2E-NUMBERS {json.dumps({'create_to_failed_seconds': round(seconds, 1)})}")
    status = job["status"]
    assert status["phase"] == "Failed", status
    failure = status["lastFailure"]
    assert failure["reason"] == "ConfigurationError"
    assert failure["exitCode"] == 78
    assert failure["counted"] is False
    assert "neither a Cairn manifest.json nor a DCP .metadata" in failure["message"]
    assert status.get("restarts", 0) == 0
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "ConfigurationError"
    assert "neither a Cairn manifest.json" in failed["message"]
    assert not (status.get("checkpoints") or {}).get("lastCommitted")


class _Payload:
    """Unpickling this creates `marker`: what a hostile import would run in rank 0."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_resume_uri_with_a_pickle_payload_fails_the_job_and_the_payload_never_runs(
    devcluster: Any, space: tuple[str, str], tmp_path: pathlib.Path
) -> None:
    namespace, bucket = space
    marker = tmp_path / "payload-ran"
    s3 = devcluster.target.s3_client()
    s3.put_object(Bucket=bucket, Key="hostile/.metadata", Body=pickle.dumps(_Payload(marker)))
    s3.put_object(Bucket=bucket, Key="hostile/__0_0.distcp", Body=b"\0" * 64)
    body = demo.quickstart_manifest(devcluster.target, name="hostile")
    ckpt = body["spec"]["checkpoint"]
    ckpt["upload"]["uri"] = f"s3://{bucket}/hostile-job"
    ckpt["resume"] = {"uri": f"s3://{bucket}/hostile"}
    body["spec"]["restartPolicy"] = {"maxRestarts": 3, "backoffSeconds": 1}
    job = demo.run_job(
        api_client=devcluster.api_client,
        namespace=namespace,
        body=body,
        kill_rank_after_commit=None,
        on_row=lambda row: None,
        timeout=300,
    )
    status = job["status"]
    assert status["phase"] == "Failed", status
    failure = status["lastFailure"]
    assert failure["reason"] == "ConfigurationError"
    assert failure["exitCode"] == 78
    assert "posix.system" in failure["message"], failure["message"]
    assert status.get("restarts", 0) == 0
    assert not marker.exists(), "the payload ran in a rank"
    # The import source is read, never written or deleted.
    keys = s3.list_objects_v2(Bucket=bucket, Prefix="hostile/")["Contents"]
    assert sorted(obj["Key"] for obj in keys) == ["hostile/.metadata", "hostile/__0_0.distcp"]
