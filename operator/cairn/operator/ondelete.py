"""``onDelete: Delete``: stop the job's pods, then empty its S3 prefix, bounded.

IO (the API server, S3 through ``s3pass.cleanup``). ``handlers.on_delete``
(kopf's deletion handler, before the finalizer goes) calls ``clean_up``;
a failed attempt sets the job's ``CleanupFailed`` condition (reason
``CleanupRetrying``, naming the prefix and what failed) and raises
``RetryLaterError`` with the delay ``core.cleanup`` drew (doubling, capped,
jittered), which ``handlers`` turns into ``kopf.TemporaryError`` (kopf keeps
the retry count in the job's annotations, so an operator restart does not
reset it). The ``cleanup_attempts``-th failure sets ``CleanupFailed``
(``CleanupAttemptsExhausted``), posts a Warning ``CleanupFailed`` Event and
returns: the finalizer goes, the objects it could not delete stay, and a
deletion (a namespace's too) never wedges on an unreachable store. ``Retain``
touches nothing; a prefix the job does not own (``prefixapply``), or a
store the operator's settings refuse, is left alone with ``CleanupSkipped``.
"""

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kubernetes import client
from kubernetes.client import exceptions as k8s_exceptions

from cairn.api import trainingjob
from cairn.operator import jobapply, kubeapi, prefixapply, s3observe, s3pass
from cairn.operator.core import cleanup, conditions, jobobserve, k8stypes, podowner, tunables
from cairn.operator.reconcile import clock, list_pods

LOG = logging.getLogger(__name__)
InStorageThread = Callable[..., Awaitable[Any]]
"""Runs a blocking S3 call in the operator's S3 threads."""


class RetryLaterError(Exception):
    """This cleanup attempt failed; try again after ``delay`` seconds."""

    def __init__(self, message: str, *, delay: float) -> None:
        super().__init__(message)
        self.delay = delay


def _own_pods(api: kubeapi.KubeApi, job: trainingjob.TrainingJob) -> list[jobobserve.ObservedPod]:
    """The job's own pods (``podowner``) from the API server: a pod that only
    carries the job's labels is never deleted with it."""
    name, uid = job.metadata.name, job.metadata.uid
    listed = list_pods(api, job.metadata.namespace, name)
    return [p for p in listed if podowner.owns(p, job_name=name, job_uid=uid)]


def _delete_pods(api: kubeapi.KubeApi, namespace: str, pods: list[jobobserve.ObservedPod]) -> None:
    for pod in pods:
        # The uid precondition: a successor with the same name is not this pod.
        options = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=pod.uid))
        try:
            api.core.delete_namespaced_pod(pod.name, namespace, body=options)
        except k8s_exceptions.ApiException as error:
            if error.status not in (404, 409):
                raise


async def _pods_gone(
    api: kubeapi.KubeApi, job: trainingjob.TrainingJob, settings: tunables.Reconcile
) -> None:
    """Delete the job's pods (their grace period lets the writer finish) and wait,
    bounded by that grace period plus a margin, until the API server has none."""
    bound = job.spec.checkpoint.final_checkpoint_grace_seconds + settings.pod_gone_margin_seconds
    deadline = time.monotonic() + bound
    pods = await asyncio.to_thread(_own_pods, api, job)
    if pods:
        await asyncio.to_thread(_delete_pods, api, job.metadata.namespace, pods)
    while pods and time.monotonic() < deadline:
        await asyncio.sleep(settings.pod_gone_poll_seconds)
        pods = await asyncio.to_thread(_own_pods, api, job)
    if pods:
        LOG.warning(
            "onDelete of %s/%s: pods %s still exist after %.0f s; cleaning up anyway",
            job.metadata.namespace,
            job.metadata.name,
            ",".join(p.name for p in pods),
            bound,
        )


def _show_condition(
    api: kubeapi.KubeApi,
    raw: dict[str, Any],
    job: trainingjob.TrainingJob,
    desired: conditions.Desired,
) -> None:
    """Set ``CleanupFailed`` on the job being deleted, the other conditions kept.
    Best effort: a failed patch loses only the view (the Event still goes)."""
    status = raw.get("status")
    listed = cleanup.with_condition(
        raw=status.get("conditions") if isinstance(status, dict) else None,
        parsed=job.status.conditions,
        desired=desired,
        generation=job.metadata.generation,
        now=clock(),
    )
    try:
        jobapply.patch_status(api, jobapply.JobRef.of(raw), {"conditions": listed})
    except k8s_exceptions.ApiException as error:
        LOG.warning(
            "%s on %s/%s not set: %s",
            desired.type,
            job.metadata.namespace,
            job.metadata.name,
            error.reason,
        )


async def clean_up(
    *,
    raw: dict[str, Any],
    api: kubeapi.KubeApi,
    retry: int,
    in_storage_thread: InStorageThread,
    settings: tunables.Settings = tunables.DEFAULT,
) -> None:
    """One attempt (``retry`` failed before) at ``onDelete`` for the job ``raw``."""
    job = jobobserve.parse_job(raw)
    if isinstance(job, jobobserve.InvalidJob):
        return
    checkpoint = job.spec.checkpoint
    if not job.spec.managed_by_cairn or checkpoint.on_delete != "Delete" or not checkpoint.upload:
        s3observe.forget_credentials(job.metadata.uid)
        return
    key = (job.metadata.namespace, job.metadata.name)
    attempt = retry + 1
    # Pods still uploading would leave orphans behind the deletion: stop them first.
    await _pods_gone(api, job, settings.reconcile)
    notice: k8stypes.Event | None = None
    try:
        count = await in_storage_thread(s3pass.cleanup, api=api, raw=raw, job=job)
        LOG.info("onDelete=Delete: removed %d objects of %s/%s from S3", count, *key)
    except prefixapply.NotOwnedError as refused:
        notice = k8stypes.Event(
            type="Warning",
            reason="CleanupSkipped",
            message=f"onDelete: Delete did not delete under {checkpoint.upload.uri}: "
            f"{refused.claim.message}",
        )
    except s3observe.StoreError as failure:
        LOG.warning("cleanup of %s/%s, attempt %d: %s", *key, attempt, failure)
        verdict = cleanup.after_failure(
            attempt=attempt,
            uri=checkpoint.upload.uri,
            failure=str(failure),
            settings=settings.storage,
            draw=random.random(),
        )
        await in_storage_thread(_show_condition, api, raw, job, verdict.condition)
        if verdict.delay is not None:
            raise RetryLaterError(
                f"S3 cleanup attempt {attempt} failed", delay=verdict.delay
            ) from None
        notice = k8stypes.Event(
            type="Warning",
            reason="CleanupFailed",
            message=f"S3 prefix {checkpoint.upload.uri} not emptied after {attempt} attempts: {failure}",
        )
    if notice is not None:
        await in_storage_thread(
            jobapply.post_event, api, jobapply.JobRef.of(raw), notice, now=clock()
        )
    s3observe.forget_credentials(job.metadata.uid)
