"""One S3 pass for one TrainingJob: observe the prefix, plan, delete, record.

Blocking (boto3 and the Kubernetes client): ``handlers`` runs these in a
worker thread. ``storage_pass`` = ``s3store.observe`` -> ``remoteplan.plan``
-> ``s3store.delete_steps`` -> merge patch of ``status.storage`` (field
manager ``cairn-operator``) -> events. ``cleanup`` is the ``onDelete: Delete``
deletion of the prefix. Nothing here writes the writer's ``step`` or
``checkpoints``.
"""

import dataclasses
import datetime
import logging
from collections.abc import Callable
from typing import Any

from cairn.api import jobstatus, trainingjob
from cairn.operator import effects, observe, plan, remoteplan, s3store

LOG = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PassResult:
    plan: remoteplan.RemotePlan | None
    deleted: tuple[int, ...]
    error: str | None
    patch: dict[str, Any] | None
    notices: tuple[remoteplan.Notice, ...]
    patched_object: dict[str, Any] | None = None
    """The job as the status patch returned it (fresher than a watch cache)."""


def protected_steps(job: trainingjob.TrainingJob, status: jobstatus.TrainingJobStatus) -> set[int]:
    """Steps retention never deletes: what the job resumed from or will resume from."""
    keep: set[int] = set()
    ckpts = status.checkpoints
    if ckpts is not None and ckpts.resumed_from is not None:
        keep.add(ckpts.resumed_from.step)
    if job.spec.checkpoint.resume.step is not None:
        keep.add(job.spec.checkpoint.resume.step)
    return keep


def plan_for(
    job: trainingjob.TrainingJob,
    status: jobstatus.TrainingJobStatus,
    observation: s3store.Observation,
) -> remoteplan.RemotePlan:
    ckpts = status.checkpoints
    in_flight = frozenset(f.step for f in (ckpts.in_flight or ())) if ckpts else frozenset()
    last_committed = (
        ckpts.last_committed.step if ckpts is not None and ckpts.last_committed else None
    )
    return remoteplan.plan(
        listing=observation.listing,
        manifests=observation.manifests,
        remote=job.spec.checkpoint.retention.remote,
        protected=frozenset(protected_steps(job, status)),
        in_flight=in_flight,
        last_committed=last_committed,
    )


def post_event(api: Any, raw: dict[str, Any], notice: remoteplan.Notice) -> None:
    event = plan.Event(type=notice.type, reason=notice.reason, message=notice.message)
    effects.post_event(api, effects.JobRef.of(raw), event, now=datetime.datetime.now(datetime.UTC))


def storage_pass(
    *,
    api: Any,
    raw: dict[str, Any],
    job: trainingjob.TrainingJob,
    cache: s3store.HeadCache,
    now: Callable[[], datetime.datetime],
) -> PassResult:
    """Verify the prefix, apply retention, record the outcome. Raises ApiException
    only for the status patch; S3 failures end up in ``status.storage.lastError``."""
    upload = job.spec.checkpoint.upload
    if upload is None:
        raise ValueError("storage_pass needs spec.checkpoint.upload")
    status = observe.parse_status(raw)
    ref = effects.JobRef.of(raw)
    namespace, name = ref.namespace, ref.name
    target = s3store.Target.parse(upload.uri)
    result: remoteplan.RemotePlan | None = None
    deleted: tuple[int, ...] = ()
    error: str | None = None
    try:
        s3 = s3store.client_for(api, namespace, upload, job_uid=job.metadata.uid)
        result = plan_for(job, status, s3store.observe(s3, target, cache=cache))
        if result.deletions:
            deleted = s3store.delete_steps(s3, target, result.deletions)
    except s3store.StoreError as failure:
        error = str(failure)[:1024]
        LOG.warning("S3 pass of %s/%s: %s", namespace, name, error)
    if result is not None and deleted != result.deleted_steps:
        result = None  # a deletion failed half-way: do not record a stale listing
    patch, notices = remoteplan.storage_update(
        previous=status.storage, result=result, deleted=deleted, error=error, now=now()
    )
    patched = effects.patch_status(api, ref, {"storage": patch}) if patch is not None else None
    for notice in notices:
        post_event(api, raw, notice)
    if deleted:
        LOG.info("retention in %s/%s deleted steps %s", namespace, name, deleted)
    return PassResult(
        plan=result,
        deleted=deleted,
        error=error,
        patch=patch,
        notices=notices,
        patched_object=patched,
    )


def cleanup(*, api: Any, raw: dict[str, Any], job: trainingjob.TrainingJob) -> int:
    """``onDelete: Delete``: remove the job's step folders from S3; the objects deleted.

    Raises ``s3store.StoreError``; the caller retries and gives up bounded.
    A second listing after the deletion catches an object the writer put
    while the first ran.
    """
    upload = job.spec.checkpoint.upload
    if upload is None:
        return 0
    s3 = s3store.client_for(api, job.metadata.namespace, upload, job_uid=job.metadata.uid)
    target = s3store.Target.parse(upload.uri)
    count = s3store.delete_prefix(s3, target)
    count += s3store.delete_prefix(s3, target)
    return count
