"""Apply step of the reconcile: ``apply()`` carries out one ``jobplan.Plan``.

IO (the Kubernetes client); called by ``reconcile`` once per cycle. Order:
status merge patch (records the decision) -> deletes -> creates -> events.
Creates treat 409 AlreadyExists as done (names are deterministic) only when
the existing object carries this job's controller ownerReference; anything
else (a foreign object with a child's name, a 422, a 403 from admission or
quota) is returned as an ``jobobserve.CreateError`` for the next plan to show,
never adopted and never only logged; after a per-job child fails, no pod is
created in that pass. Deletes treat 404 as done (and report it: the watch
cache may still hold the pod) and carry the pod's uid as a precondition, so
a successor with the same name is never hit (a failed precondition, 409, is
also done).
The status patch carries ``observedGeneration`` and only operator-owned
fields; it is a JSON merge patch, so the writer's ``step`` and
``checkpoints`` are untouched. Events are posted only after the status patch
succeeded. Blocking calls: run ``apply`` in a worker thread from async code.
Responses the operator does not read (creates, deletes, events) are not
decoded into the client's model classes (``_preload_content=False``).
The job's manifest-key Secret is the one child whose content is drawn here:
32 random bytes from ``secrets`` at create time (``_with_fresh_keyring``),
never in the pure plan, so no key is ever part of a Plan, a log line or an
event; a 409 keeps the existing Secret and so the job's key. A ray job's
Ray token Secret is drawn the same way (``_with_fresh_secret``).
"""

import base64
import dataclasses
import datetime
import json
import logging
import secrets
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client import exceptions as k8s_exceptions

from cairn.api import manifest, podenv, trainingjob
from cairn.operator import kubeapi
from cairn.operator.core import clock, jobobserve, jobplan, k8stypes, names

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
    create_errors: tuple[jobobserve.CreateError, ...] = ()
    gone: tuple[str, ...] = ()
    """Children a delete found already gone (404): the pod cache is behind."""


def _unread(response: kubeapi.RawResponse) -> None:
    """Done with a response whose body we do not need: the Python client would
    otherwise decode it into its model classes (V1Pod, V1Event...), which costs
    more CPU than the call itself; the connection goes back to the pool."""
    response.drain_conn()
    response.release_conn()


def _ignore(error: k8s_exceptions.ApiException, *codes: int) -> None:
    if error.status not in codes:
        raise error


def _api_message(error: k8s_exceptions.ApiException) -> tuple[str, str]:
    """(reason, message) of a failed call, as the API server's Status says them."""
    try:
        body = json.loads(error.body or "{}")
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    reason = str(body.get("reason") or error.reason or "")
    return reason, str(body.get("message") or error.reason or f"HTTP {error.status}")


api_message = _api_message
"""Public name for other side-effect modules (``kueueapply``)."""


def _owned_by(existing: Any, job_uid: str) -> bool:
    refs = getattr(existing.metadata, "owner_references", None) or ()
    return any(ref.uid == job_uid and ref.controller for ref in refs)


INITIAL_KEY_ID = "k1"
"""Id of a job's first manifest key; rotation adds others (docs/security.md)."""
KEY_BYTES = 32


def _with_fresh_keyring(secret: k8stypes.Secret) -> k8stypes.Secret:
    """The job's keyring Secret with a newly drawn key (only ever sent in a create)."""
    ring = manifest.Keyring(
        current=INITIAL_KEY_ID, keys={INITIAL_KEY_ID: secrets.token_bytes(KEY_BYTES)}
    )
    encoded = base64.b64encode(manifest.dump_keyring(ring)).decode()
    return {**secret, "data": {podenv.MANIFEST_KEYRING_FILE: encoded}}


RAY_TOKEN_BYTES = 32


def _with_fresh_secret(secret: k8stypes.Secret) -> k8stypes.Secret:
    """The Secret's content, drawn now: a ray job's Ray token (32 random bytes
    as hex, as Ray's own generator makes them) or the manifest keyring."""
    job = secret["metadata"]["labels"][names.LABEL_JOB]
    if secret["metadata"]["name"] == names.ray_token_secret_name(job):
        token = secrets.token_hex(RAY_TOKEN_BYTES).encode()
        return {**secret, "data": {podenv.RAY_TOKEN_KEY: base64.b64encode(token).decode()}}
    return _with_fresh_keyring(secret)


def _create(api: kubeapi.KubeApi, child: k8stypes.Child) -> jobobserve.CreateError | None:
    """Create ``child``; None when it exists now and is ours."""
    namespace = child["metadata"]["namespace"]
    name = child["metadata"]["name"]
    kind = child["kind"]
    core, rbac = api.core, api.rbac
    calls: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
        "Pod": (core.create_namespaced_pod, core.read_namespaced_pod),
        "Service": (core.create_namespaced_service, core.read_namespaced_service),
        "ServiceAccount": (
            core.create_namespaced_service_account,
            core.read_namespaced_service_account,
        ),
        "Role": (rbac.create_namespaced_role, rbac.read_namespaced_role),
        "RoleBinding": (rbac.create_namespaced_role_binding, rbac.read_namespaced_role_binding),
        "Secret": (core.create_namespaced_secret, core.read_namespaced_secret),
        "NetworkPolicy": (
            api.networking.create_namespaced_network_policy,
            api.networking.read_namespaced_network_policy,
        ),
    }
    create, read = calls[kind]
    body = _with_fresh_secret(child) if child["kind"] == "Secret" else child
    try:
        _unread(create(namespace, body, field_manager=names.FIELD_MANAGER, _preload_content=False))
        return None
    except k8s_exceptions.ApiException as error:
        if error.status != CONFLICT:
            reason, message = _api_message(error)
            return jobobserve.CreateError(
                kind=kind, name=name, code=error.status or 0, reason=reason, message=message
            )
    owner = child["metadata"]["ownerReferences"][0]["uid"]
    try:
        existing = read(name, namespace)
    except k8s_exceptions.ApiException as error:
        if error.status == NOT_FOUND:  # deleted since: the next pass creates it
            return None
        raise
    if _owned_by(existing, owner):
        return None
    return jobobserve.CreateError(
        kind=kind,
        name=name,
        code=CONFLICT,
        reason="AlreadyExists",
        message=f"{kind} {name} exists without this job's ownerReference",
        conflict=True,
    )


def _create_all(
    api: kubeapi.KubeApi, children: tuple[k8stypes.Child, ...]
) -> tuple[list[str], list[jobobserve.CreateError]]:
    """Create in order: (created or already ours, refused). After a per-job
    child fails, skip the pods (they would start without their Service,
    ServiceAccount or Role)."""
    done: list[str] = []
    errors: list[jobobserve.CreateError] = []
    for child in children:
        if errors and child["kind"] == "Pod" and any(e.kind != "Pod" for e in errors):
            break
        error = _create(api, child)
        if error is None:
            done.append(f"{child['kind']}/{child['metadata']['name']}")
        else:
            LOG.warning(
                "create of %s %s/%s refused: %s",
                error.kind,
                child["metadata"]["namespace"],
                error.name,
                error.message,
            )
            errors.append(error)
    return done, errors


def _delete(api: kubeapi.KubeApi, target: jobplan.Delete) -> bool:
    """Delete ``target``; False when it was already gone (404)."""
    core = api.core
    options = client.V1DeleteOptions(
        preconditions=client.V1Preconditions(uid=target.uid) if target.uid else None
    )
    deleters: dict[str, Callable[..., Any]] = {
        "Pod": core.delete_namespaced_pod,
        "Service": core.delete_namespaced_service,
        "ServiceAccount": core.delete_namespaced_service_account,
    }
    try:
        _unread(
            deleters[target.kind](
                target.name, target.namespace, body=options, _preload_content=False
            )
        )
    except k8s_exceptions.ApiException as error:
        _ignore(error, NOT_FOUND, CONFLICT)
        return bool(error.status != NOT_FOUND)
    return True


def event_body(*, job: JobRef, event: k8stypes.Event, now: datetime.datetime) -> dict[str, Any]:
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
        "firstTimestamp": clock.rfc3339(now),
        "lastTimestamp": clock.rfc3339(now),
        "count": 1,
        "source": {"component": names.FIELD_MANAGER},
        "reportingComponent": names.FIELD_MANAGER,
        "reportingInstance": names.FIELD_MANAGER,
    }


def patch_status(api: kubeapi.KubeApi, job: JobRef, status: dict[str, Any]) -> dict[str, Any]:
    """Merge-patch the job's /status as the operator; the job as the server left it."""
    patched: dict[str, Any] = api.custom.patch_namespaced_custom_object_status(
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


def post_event(
    api: kubeapi.KubeApi, job: JobRef, event: k8stypes.Event, *, now: datetime.datetime
) -> None:
    """Post an Event about the job; best effort (a failure is logged)."""
    try:
        _unread(
            api.core.create_namespaced_event(
                job.namespace, event_body(job=job, event=event, now=now), _preload_content=False
            )
        )
    except k8s_exceptions.ApiException as error:
        LOG.warning(
            "event %s on %s/%s not posted: %s", event.reason, job.namespace, job.name, error.reason
        )


def apply(
    *, api: kubeapi.KubeApi, job: JobRef, todo: jobplan.Plan, now: Callable[[], datetime.datetime]
) -> Result:
    """Apply ``todo``; raises ApiException on anything but the tolerated codes."""
    patched: dict[str, Any] | None = None
    if todo.status is not None:
        patched = patch_status(api, job, dict(todo.status))
    gone = [f"{t.kind}/{t.name}" for t in todo.deletes if not _delete(api, t)]
    created, errors = _create_all(api, todo.creates)
    for event in todo.events:
        post_event(api, job, event, now=now())
    return Result(
        created=tuple(created),
        deleted=tuple(f"{d.kind}/{d.name}" for d in todo.deletes),
        status_patched=patched is not None,
        events=len(todo.events),
        patched_object=patched,
        create_errors=tuple(errors),
        gone=tuple(gone),
    )
