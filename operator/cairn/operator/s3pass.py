"""One S3 pass for one TrainingJob: observe -> plan -> apply, like the reconcile.

Blocking (boto3 and the Kubernetes client): ``handlers`` runs these in a
worker thread. ``storage_pass`` reads top to bottom:

- observe (``s3observe``, ``prefixapply``): ``prefixapply.open_prefix`` (the
  operator's S3 settings and the prefix claim: nothing below happens under a
  prefix the job does not own), the job's manifest keyring
  (``s3observe.manifest_keyring``), then ``s3observe.observe`` (list; read
  manifests and head listed files whose ETag is new);
- plan (``s3plan``, ``prefixplan``; pure): ``s3plan.plan_job``
  (verification and retention), then ``s3plan.storage_update`` and
  ``prefixplan.with_claim`` (the ``status.storage`` merge patch and the
  Events);
- apply (``s3apply``): deletions (manifest first), the status patch (field
  manager ``cairn-operator``), the Events.

A long listing goes on over several passes (``core.s3slice``): a pass that
listed its share ends there (``PassResult.goes_on``: nothing judged, deleted
or written), and deletions planned from a listing read over several passes
are checked against the store first (``s3list.stale_deletions``: any
change and nothing is deleted, the listing starts over).

``cleanup`` is the ``onDelete: Delete`` deletion of an owned prefix. Nothing
here writes the writer's ``step`` or ``checkpoints``.
"""

import dataclasses
import logging
import typing
from typing import Any

from kubernetes.client import exceptions as k8s_exceptions

from cairn.api import jobstatus, trainingjob
from cairn.api import manifest as manifest_mod
from cairn.operator import jobapply, kubeapi, prefixapply, s3apply, s3list, s3observe
from cairn.operator.core import clock, jobobserve, k8stypes, prefixplan, s3plan, tunables

if typing.TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

LOG = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PassResult:
    plan: s3plan.RemotePlan | None
    deleted: tuple[int, ...]
    error: str | None
    patch: dict[str, Any] | None
    events: tuple[k8stypes.Event, ...]
    patched_object: dict[str, Any] | None = None
    """The job as the status patch returned it (fresher than a watch cache)."""
    goes_on: bool = False
    """The listing goes on (or starts over) in the job's next pass, due at once
    (``core.s3slice``); nothing was judged, deleted or written."""
    capped: int = 0
    """Listings in a row that reached ``list_max_keys`` (``s3loop`` backs off)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Seen:
    """What the observe step got: the claim, and a client and listing when owned."""

    claim: prefixplan.Claim | None = None
    s3: "S3Client | None" = None
    observation: s3plan.Observation | None = None
    keyring: manifest_mod.Keyring | None = None
    error: str | None = None
    unfinished: bool = False
    """The listing goes on in the next pass (``s3observe.ListingGoesOnError``)."""


def _observe(
    *,
    api: kubeapi.KubeApi,
    job: trainingjob.TrainingJob,
    target: s3observe.Target,
    caches: s3observe.Caches,
    deadline: s3observe.Deadline,
    bounds: tunables.S3,
) -> _Seen:
    """Claim the prefix, then list and judge it; an S3 failure (or the deadline)
    becomes ``error``."""
    claim: prefixplan.Claim | None = None
    try:
        # Only under a prefix this job owns, reached the way the settings allow.
        access = prefixapply.open_prefix(api=api, job=job)
        claim = access.claim
        if access.s3 is None:
            return _Seen(claim=claim)
        keyring = s3observe.manifest_keyring(
            api, job=job.metadata.name, namespace=job.metadata.namespace, job_uid=job.metadata.uid
        )
        deadline.check("listing the prefix")
        who = s3observe.Identity(job_uid=job.metadata.uid or None, keyring=keyring)
        seen = s3observe.observe(
            access.s3,
            target,
            caches=caches,
            who=who,
            deadline=deadline,
            bounds=bounds,
            sliced=True,
        )
        return _Seen(claim=claim, s3=access.s3, observation=seen, keyring=keyring)
    except s3observe.ListingGoesOnError:
        return _Seen(claim=claim, unfinished=True)
    except s3observe.StoreError as failure:
        return _Seen(claim=claim, error=str(failure)[:1024])


def storage_pass(
    *,
    api: kubeapi.KubeApi,
    raw: dict[str, Any],
    job: trainingjob.TrainingJob,
    caches: s3observe.Caches,
    now: clock.Clock,
    deadline: s3observe.Deadline = s3observe.NO_DEADLINE,
    bounds: tunables.S3 = tunables.DEFAULT.s3,
) -> PassResult:
    """Verify the prefix, apply retention, record the outcome. Raises ApiException
    only for the status patch; S3 failures end up in ``status.storage.lastError``."""
    upload = job.spec.checkpoint.upload
    if upload is None:
        raise ValueError("storage_pass needs spec.checkpoint.upload")
    status = jobobserve.parse_status(raw)
    ref = jobapply.JobRef.of(raw)
    target = s3observe.Target.parse(upload.uri)
    # observe
    seen = _observe(
        api=api, job=job, target=target, caches=caches, deadline=deadline, bounds=bounds
    )
    view, caches.listing.view = caches.listing.view, None
    if seen.unfinished:
        return _going_on()
    # plan (pure)
    todo = None
    if seen.observation is not None:
        todo = s3plan.plan_job(
            job=job, status=status, observation=seen.observation, keyring=seen.keyring
        )
    # apply: nothing deleted on a stale view; deletions, then the status and the events
    error = seen.error
    if todo is not None and todo.deletions and seen.s3 is not None and view is not None:
        stale, failed = _stale_steps(seen.s3, target, view=view, todo=todo, bounds=bounds)
        if failed is not None:
            error, todo = failed, None
        if stale:
            LOG.info(
                "S3 pass of %s/%s: steps %s changed while listed", ref.namespace, ref.name, stale
            )
            return _going_on()  # listed again from scratch: nothing deleted on a stale view
    return _apply(
        api=api,
        ref=ref,
        previous=status.storage,
        seen=seen,
        target=target,
        todo=todo,
        error=error,
        now=now,
        capped=caches.listing.capped,
    )


def _stale_steps(
    s3: "S3Client",
    target: s3observe.Target,
    *,
    view: s3list.View,
    todo: s3plan.RemotePlan,
    bounds: tunables.S3,
) -> tuple[tuple[int, ...], str | None]:
    """The planned deletions whose folders changed since the sliced listing ``view``
    (any: the pass deletes nothing and lists again), or the store's failure."""
    try:
        stale = s3list.stale_deletions(
            s3, target, view=view, steps=todo.deleted_steps, bounds=bounds
        )
    except s3list.StoreError as failure:
        return (), str(failure)[:1024]
    return stale, None


def _apply(
    *,
    api: kubeapi.KubeApi,
    ref: jobapply.JobRef,
    previous: jobstatus.StorageStatus | None,
    seen: _Seen,
    target: s3observe.Target,
    todo: s3plan.RemotePlan | None,
    error: str | None,
    now: clock.Clock,
    capped: int,
) -> PassResult:
    """Deletions, then what the status and the events say about them."""
    deleted: tuple[int, ...] = ()
    if todo is not None and todo.deletions and seen.s3 is not None:
        deleted, error = s3apply.delete_planned(seen.s3, target, todo)
        if deleted != todo.deleted_steps:
            todo = None  # a deletion failed half-way: do not record a stale listing
    if error is not None:
        LOG.warning("S3 pass of %s/%s: %s", ref.namespace, ref.name, error)
    patch, events = s3plan.storage_update(
        previous=previous, result=todo, deleted=deleted, error=error, now=now()
    )
    patch, events = prefixplan.with_claim(patch, events, previous=previous, claim=seen.claim)
    patched = s3apply.record(api=api, job=ref, patch=patch, events=events, now=now())
    if deleted:
        LOG.info("retention in %s/%s deleted steps %s", ref.namespace, ref.name, deleted)
    return PassResult(
        plan=todo,
        deleted=deleted,
        error=error,
        patch=patch,
        events=events,
        patched_object=patched,
        capped=capped,
    )


def _going_on() -> PassResult:
    """A pass that listed its share of a listing that goes on: nothing else done."""
    return PassResult(plan=None, deleted=(), error=None, patch=None, events=(), goes_on=True)


def report_abandoned(*, api: kubeapi.KubeApi, raw: dict[str, Any], at: s3observe.Deadline) -> None:
    """A pass still in an S3 call at its deadline: ``status.storage.lastError`` says so
    now (the call ends on its own, bounded by the client's timeouts). Never raises."""
    ref = jobapply.JobRef.of(raw)
    message = (
        f"S3 pass abandoned at its deadline ({at.seconds:g} s): the store accepts"
        " connections but does not answer in time; the next pass tries again"
    )
    LOG.warning("S3 pass of %s/%s: %s", ref.namespace, ref.name, message)
    try:
        jobapply.patch_status(api, ref, {"storage": {"lastError": message}})
    except k8s_exceptions.ApiException as error:
        LOG.warning(
            "storage status of %s/%s not patched: %s", ref.namespace, ref.name, error.reason
        )


def cleanup(*, api: kubeapi.KubeApi, raw: dict[str, Any], job: trainingjob.TrainingJob) -> int:
    """``onDelete: Delete``: remove the job's step folders from S3; the objects deleted.

    Raises ``s3observe.StoreError``; the caller retries and gives up bounded.
    Raises ``prefixapply.NotOwnedError`` (nothing deleted) when the job does not own
    the prefix or the operator's settings refuse the store; the owner object is
    released last.
    A second listing after the deletion catches an object the writer put
    while the first ran.
    """
    upload = job.spec.checkpoint.upload
    if upload is None:
        return 0
    access = prefixapply.open_prefix(api=api, job=job)
    if access.s3 is None:
        raise prefixapply.NotOwnedError(access.claim)
    count = s3apply.delete_prefix(access.s3, access.target)
    count += s3apply.delete_prefix(access.s3, access.target)
    prefixapply.release(access.s3, access.target, prefixapply.me(job))
    return count
