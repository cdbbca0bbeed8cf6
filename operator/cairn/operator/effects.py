"""effects.apply(): carry out one Plan with the Kubernetes client.

The only module besides ``handlers`` that talks to the API server. Order:
status merge patch (records the decision) -> deletes -> creates -> events.
Creates treat 409 AlreadyExists as done (names are deterministic); deletes
treat 404 as done and carry the pod's uid as a precondition, so a successor
with the same name is never hit (a failed precondition, 409, is also done).
The status patch carries ``observedGeneration`` and only operator-owned
fields; it is a JSON merge patch, so the writer's ``step`` and
``checkpoints`` are untouched. Events are posted only after the status patch
succeeded. Blocking calls: run ``apply`` in a worker thread from async code.
"""

import dataclasses
import datetime
import logging
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client import exceptions as k8s_exceptions

from cairn.api import trainingjob
from cairn.operator import k8stypes, names, plan

LOG = logging.getLogger(__name__)
MERGE_PATCH = "application/merge-patch+json"
CONFLICT = 409
NOT_FOUND = 404


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class JobRef:
    """The TrainingJob the plan is for (events point at it)."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def of(cls, raw: dict[str, Any]) -> "JobRef":
        meta = raw.get("metadata", {})
        return cls(
            name=meta.get("name", ""), namespace=meta.get("namespace", ""), uid=meta.get("uid", "")
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Result:
    created: tuple[str, ...] = ()
    deleted: tuple[str, ...] = ()
    status_patched: bool = False
    events: int = 0
    patched_object: dict[str, Any] | None = None
    """The job as the status patch left it (fresher than a watch cache)."""


def _ignore(error: k8s_exceptions.ApiException, *codes: int) -> None:
    if error.status not in codes:
        raise error


def _create(api: Any, child: k8stypes.Child) -> None:
    namespace = child["metadata"]["namespace"]
    kind = child["kind"]
    core = client.CoreV1Api(api)
    rbac = client.RbacAuthorizationV1Api(api)
    create: dict[str, Callable[..., Any]] = {
        "Pod": core.create_namespaced_pod,
        "Service": core.create_namespaced_service,
        "ServiceAccount": core.create_namespaced_service_account,
        "Role": rbac.create_namespaced_role,
        "RoleBinding": rbac.create_namespaced_role_binding,
    }
    try:
        create[kind](namespace, child, field_manager=names.FIELD_MANAGER)
    except k8s_exceptions.ApiException as error:
        _ignore(error, CONFLICT)


def _delete(api: Any, target: plan.Delete) -> None:
    core = client.CoreV1Api(api)
    options = client.V1DeleteOptions(
        preconditions=client.V1Preconditions(uid=target.uid) if target.uid else None
    )
    deleters: dict[str, Callable[..., Any]] = {
        "Pod": core.delete_namespaced_pod,
        "Service": core.delete_namespaced_service,
        "ServiceAccount": core.delete_namespaced_service_account,
    }
    try:
        deleters[target.kind](target.name, target.namespace, body=options)
    except k8s_exceptions.ApiException as error:
        _ignore(error, NOT_FOUND, CONFLICT)


def _time(now: datetime.datetime) -> str:
    return now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def event_body(*, job: JobRef, event: plan.Event, now: datetime.datetime) -> dict[str, Any]:
    """A core/v1 Event on the job (pure; exposed for tests)."""
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{job.name}.", "namespace": job.namespace},
        "involvedObject": {
            "apiVersion": trainingjob.API_VERSION,
            "kind": trainingjob.KIND,
            "name": job.name,
            "namespace": job.namespace,
            "uid": job.uid,
        },
        "type": event.type,
        "reason": event.reason,
        "message": event.message[:1024],
        "firstTimestamp": _time(now),
        "lastTimestamp": _time(now),
        "count": 1,
        "source": {"component": names.FIELD_MANAGER},
        "reportingComponent": names.FIELD_MANAGER,
        "reportingInstance": names.FIELD_MANAGER,
    }


def patch_status(api: Any, job: JobRef, status: dict[str, Any]) -> dict[str, Any]:
    """Merge-patch the job's /status as the operator; the job as the server left it."""
    patched: dict[str, Any] = client.CustomObjectsApi(api).patch_namespaced_custom_object_status(
        trainingjob.GROUP,
        trainingjob.VERSION,
        job.namespace,
        trainingjob.PLURAL,
        job.name,
        {"status": status},
        field_manager=names.FIELD_MANAGER,
        _content_type=MERGE_PATCH,
    )
    return patched


def post_event(api: Any, job: JobRef, event: plan.Event, *, now: datetime.datetime) -> None:
    """Post an Event about the job; best effort (a failure is logged)."""
    try:
        client.CoreV1Api(api).create_namespaced_event(
            job.namespace, event_body(job=job, event=event, now=now)
        )
    except k8s_exceptions.ApiException as error:
        LOG.warning(
            "event %s on %s/%s not posted: %s", event.reason, job.namespace, job.name, error.reason
        )


def apply(
    *, api: Any, job: JobRef, todo: plan.Plan, now: Callable[[], datetime.datetime]
) -> Result:
    """Apply ``todo``; raises ApiException on anything but the tolerated codes."""
    patched: dict[str, Any] | None = None
    if todo.status is not None:
        patched = patch_status(api, job, dict(todo.status))
    for target in todo.deletes:
        _delete(api, target)
    for child in todo.creates:
        _create(api, child)
    for event in todo.events:
        post_event(api, job, event, now=now())
    return Result(
        created=tuple(f"{c['kind']}/{c['metadata']['name']}" for c in todo.creates),
        deleted=tuple(f"{d.kind}/{d.name}" for d in todo.deletes),
        status_patched=patched is not None,
        events=len(todo.events),
        patched_object=patched,
    )
