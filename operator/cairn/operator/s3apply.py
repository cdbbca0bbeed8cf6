"""Apply step of the S3 pass: the plan's deletions, then its status patch and Events.

Blocking (boto3, the Kubernetes client): call from a worker thread. The one
deletion rule: every ``manifest.json`` first, one by one, then the rest in
batches (``retention.split_manifests``), so an interruption leaves at worst
an abandoned partial, never a corrupt "committed" step. The status patch and
the Events go through ``jobapply`` (field manager ``cairn-operator``, the same
Event type the reconcile posts).
"""

from __future__ import annotations

import datetime
import typing
from collections.abc import Iterable
from typing import Any

from cairn.api import retention
from cairn.operator import jobapply, kubeapi, s3list, s3observe
from cairn.operator.core import k8stypes, s3plan, tunables

if typing.TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client


def _delete_batch(
    s3: S3Client, bucket: str, keys: list[str], *, batch: int = tunables.DEFAULT.s3.delete_batch
) -> None:
    for start in range(0, len(keys), batch):
        chunk = keys[start : start + batch]
        try:
            answer = s3.delete_objects(
                Bucket=bucket,
                Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True},
            )
        except s3observe.ERRORS as error:
            raise s3observe.failure(
                f"deleting {len(chunk)} objects in s3://{bucket}", error
            ) from None
        failed = answer.get("Errors", [])
        if failed:
            first = failed[0]
            raise s3observe.StoreError(
                f"deleting s3://{bucket}/{first.get('Key', '?')} failed: {first.get('Code', '?')}"
                f" ({len(failed)} objects not deleted)"
            )


def delete_keys(s3: S3Client, bucket: str, keys: Iterable[str]) -> int:
    """Delete keys: every ``manifest.json`` first, one by one, then the rest in batches
    (``retention.split_manifests``: an interruption leaves at worst an abandoned
    partial). The operator's only deletion in S3."""
    manifests, rest = retention.split_manifests(list(keys))
    for key in manifests:
        try:
            s3.delete_object(Bucket=bucket, Key=key)
        except s3observe.ERRORS as error:
            raise s3observe.failure(f"deleting s3://{bucket}/{key}", error) from None
    _delete_batch(s3, bucket, rest)
    return len(manifests) + len(rest)


def delete_steps(
    s3: S3Client, target: s3observe.Target, deletions: Iterable[s3plan.StepDeletion]
) -> tuple[int, ...]:
    """Apply a plan's deletions step by step (manifest first); the steps deleted."""
    done: list[int] = []
    for deletion in deletions:
        delete_keys(s3, target.bucket, [target.key(deletion.step, p) for p in deletion.paths])
        done.append(deletion.step)
    return tuple(done)


def delete_planned(
    s3: S3Client, target: s3observe.Target, todo: s3plan.RemotePlan
) -> tuple[tuple[int, ...], str | None]:
    """The plan's deletions; the steps deleted, or what failed (never raises StoreError)."""
    try:
        return delete_steps(s3, target, todo.deletions), None
    except s3observe.StoreError as error:
        return (), str(error)[:1024]


def delete_prefix(s3: S3Client, target: s3observe.Target) -> int:
    """Delete every step folder under the job's prefix (manifests first); the count.

    Only the writer's layout (``step-<N>/...``) is deleted: an object of
    another name under the prefix was not written by Cairn and stays.
    """
    steps = s3list.list_steps(s3, target)
    keys = [target.key(step, path) for step, objects in steps.items() for path in objects]
    return delete_keys(s3, target.bucket, keys)


def record(
    *,
    api: kubeapi.KubeApi,
    job: jobapply.JobRef,
    patch: dict[str, Any] | None,
    events: tuple[k8stypes.Event, ...],
    now: datetime.datetime,
) -> dict[str, Any] | None:
    """The ``status.storage`` patch (when there is one), then the Events; the job
    as the patch left it. Raises ApiException for the patch only."""
    patched = jobapply.patch_status(api, job, {"storage": patch}) if patch is not None else None
    for event in events:
        jobapply.post_event(api, job, event, now=now)
    return patched
