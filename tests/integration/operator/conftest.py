"""Fixtures and helpers for the operator's tests against the devcluster.

Every test gets a fresh namespace and the shared operator process (the
`operator` fixture in tests/conftest.py). Jobs run tiny `python -c` scripts
as their pods' command (the node agent runs it as a local process), so exit
codes and timings are cheap to drive without torch. `Recorder` (and
`JobWatch`) records every version of a job or of pods through a watch, so
tests can assert on transitions too short-lived to catch by polling.
"""

import contextlib
import copy
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import urllib3
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from tests.conftest import DevclusterHandle, OperatorProcess
from tests.integration.devcluster import kube_helpers as kh

GROUP, VERSION, PLURAL = "cairn.dev", "v1alpha1", "trainingjobs"
LABEL_JOB = "cairn.dev/job-name"
WAIT = 60.0
"""Bound of every wait for the operator to act (it normally takes ~1 s)."""

SLEEP_FOREVER = "import time; time.sleep(600)"


def job_body(name: str, *, script: str, nodes: int = 2, **spec: Any) -> dict[str, Any]:
    """A TrainingJob running `python -c script` on every rank; `spec` merges on top."""
    body: dict[str, Any] = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "nodes": nodes,
            "image": "cairn-trainer:dev",
            "command": ["python", "-c", script],
            "checkpoint": {"intervalSteps": 5, "finalCheckpointGraceSeconds": 30},
            "restartPolicy": {"maxRestarts": 3, "backoffSeconds": 1, "maxBackoffSeconds": 2},
        },
    }
    for key, value in spec.items():
        if isinstance(value, dict) and isinstance(body["spec"].get(key), dict):
            body["spec"][key] = {**body["spec"][key], **copy.deepcopy(value)}
        else:
            body["spec"][key] = copy.deepcopy(value)
    return body


class Kube:
    """The clients and the few calls these tests repeat, bound to one namespace."""

    def __init__(self, handle: DevclusterHandle, namespace: str) -> None:
        self.handle = handle
        self.namespace = namespace
        self.api_client = handle.api_client
        self.core = client.CoreV1Api(handle.api_client)
        self.rbac = client.RbacAuthorizationV1Api(handle.api_client)
        self.custom = client.CustomObjectsApi(handle.api_client)

    # --- jobs -----------------------------------------------------------------
    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        job: dict[str, Any] = self.custom.create_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, body
        )
        return job

    def job(self, name: str) -> dict[str, Any]:
        job: dict[str, Any] = self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, name
        )
        return job

    def status(self, name: str) -> dict[str, Any]:
        return dict(self.job(name).get("status") or {})

    def patch_spec(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        job: dict[str, Any] = self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, name, {"spec": spec}
        )
        return job

    def wait_status(
        self, name: str, what: str, predicate: Any, *, timeout: float = WAIT
    ) -> dict[str, Any]:
        """Poll the job's status until `predicate(status)` holds."""

        def check() -> dict[str, Any] | None:
            status = self.status(name)
            return status if predicate(status) else None

        result: dict[str, Any] = kh.wait_for(check, timeout=timeout, what=f"{name}: {what}")
        return result

    def wait_phase(
        self, name: str, phase: str, *, attempt: int | None = None, timeout: float = WAIT
    ) -> dict[str, Any]:
        def reached(status: dict[str, Any]) -> bool:
            return status.get("phase") == phase and (
                attempt is None or status.get("attempt") == attempt
            )

        label = f"phase {phase}" + (f" in attempt {attempt}" if attempt else "")
        return self.wait_status(name, label, reached, timeout=timeout)

    # --- pods and events ------------------------------------------------------------
    def pods(self, job: str, *, attempt: int | None = None) -> list[Any]:
        selector = f"{LABEL_JOB}={job}"
        if attempt is not None:
            selector += f",cairn.dev/attempt={attempt}"
        items = self.core.list_namespaced_pod(self.namespace, label_selector=selector).items
        return sorted(items, key=lambda p: p.metadata.name)

    def wait_pods_running(self, job: str, *, attempt: int, count: int) -> list[Any]:
        def running() -> list[Any] | None:
            pods = self.pods(job, attempt=attempt)
            ok = len(pods) == count and all(p.status.phase == "Running" for p in pods)
            return pods if ok else None

        result: list[Any] = kh.wait_for(
            running, timeout=WAIT, what=f"{count} running pods of {job} attempt {attempt}"
        )
        return result

    def wait_no_pods_running(self, job: str) -> None:
        """Every pod of the job has terminated or is gone (deleted pods vanish)."""
        kh.wait_for(
            lambda: all(p.status.phase in ("Succeeded", "Failed") for p in self.pods(job)),
            timeout=WAIT,
            what=f"no live pod of {job}",
        )

    def wait_no_pods(self, job: str) -> None:
        kh.wait_for(lambda: not self.pods(job), timeout=WAIT, what=f"pods of {job} gone")

    def events(self, job: str) -> list[Any]:
        items = self.core.list_namespaced_event(
            self.namespace,
            field_selector=f"involvedObject.kind=TrainingJob,involvedObject.name={job}",
        ).items
        return sorted(items, key=lambda e: (e.first_timestamp or e.event_time, e.metadata.name))

    def wait_event(self, job: str, reason: str, *, contains: str = "") -> Any:
        def found() -> Any:
            return next(
                (e for e in self.events(job) if e.reason == reason and contains in e.message),
                None,
            )

        return kh.wait_for(found, timeout=WAIT, what=f"event {reason} {contains!r} on {job}")

    # --- a client acting as the job's ServiceAccount --------------------------------
    def as_service_account(self, name: str, *, pod: str | None = None) -> client.ApiClient:
        """An API client authenticated with a TokenRequest token of `name`;
        with `pod`, bound to that pod as the kubelet binds a pod's projected
        token (the API server then puts its name in userInfo.extra)."""
        bound = None
        if pod is not None:
            uid = self.core.read_namespaced_pod(pod, self.namespace).metadata.uid
            bound = client.V1BoundObjectReference(api_version="v1", kind="Pod", name=pod, uid=uid)
        request = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(
                audiences=[], expiration_seconds=600, bound_object_ref=bound
            )
        )
        token = self.core.create_namespaced_service_account_token(name, self.namespace, request)
        admin = self.api_client.configuration
        config = client.Configuration()
        config.host = admin.host
        config.ssl_ca_cert = admin.ssl_ca_cert
        config.verify_ssl = admin.verify_ssl
        config.api_key = {"authorization": f"Bearer {token.status.token}"}
        return client.ApiClient(config)


class Recorder:
    """Every watch event of a list call, in resourceVersion order, from a background watch."""

    def __init__(
        self, kube: Kube, list_call: Any, *args: Any, resource_version: str, **kwargs: Any
    ) -> None:
        self.kube = kube
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._call = (list_call, args, kwargs)
        self._rv = resource_version
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        list_call, args, kwargs = self._call
        while not self._stop.is_set():
            stream = watch.Watch()
            # A watch that breaks (timeout, API server restart) resumes where it was.
            with contextlib.suppress(ApiException, urllib3.exceptions.HTTPError, OSError):
                for event in stream.stream(
                    list_call, *args, resource_version=self._rv, timeout_seconds=2, **kwargs
                ):
                    obj = event["object"]
                    if not isinstance(obj, dict):
                        obj = self.kube.api_client.sanitize_for_serialization(obj)
                    self._rv = obj["metadata"]["resourceVersion"]
                    with self._lock:
                        self.events.append((event["type"], copy.deepcopy(obj)))
                    if self._stop.is_set():
                        break

    def recorded(self) -> list[tuple[str, dict[str, Any]]]:
        with self._lock:
            return list(self.events)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class JobWatch(Recorder):
    """Every version of one job's status."""

    def __init__(self, kube: Kube, name: str, *, resource_version: str) -> None:
        super().__init__(
            kube,
            kube.custom.list_namespaced_custom_object,
            GROUP,
            VERSION,
            kube.namespace,
            PLURAL,
            field_selector=f"metadata.name={name}",
            resource_version=resource_version,
        )

    def statuses(self) -> list[dict[str, Any]]:
        return [dict(obj.get("status") or {}) for _, obj in self.recorded()]


@pytest.fixture
def kube(devcluster: DevclusterHandle, operator: OperatorProcess) -> Iterator[Kube]:
    for namespace in kh.temp_namespace(devcluster.core, "op"):
        yield Kube(devcluster, namespace)
