"""A reconcile the real API server throttles (429 + Retry-After) waits what the server asked.

The fault comes from the real kube-apiserver, not a mock: API Priority and
Fairness. A FlowSchema sends one user (the test impersonates it) to a
priority level with no concurrency of its own, no borrowing and
``limitResponse: Reject``. APF still runs one request of such a level when
none is running, so the test keeps one request in flight (a dry-run
ConfigMap create whose body arrives only when the test lets it): from then
on every request of that user is answered 429 with the server's own
Retry-After. The operator's ``Runtime`` is built here over that user's
client, beside the shared operator, which is not throttled.

Covers: a throttled reconcile answers None and waits at least the server's
Retry-After (the backoff alone is set far below it, so only the header can
explain the wait), stretched by at most the jitter; jobs throttled together
draw different waits (no lockstep return); once the server answers again,
one reconcile succeeds and clears the job's failure count; the operator's
client (``runtime.client_retries``) does not sleep on a 429 inside the call
(urllib3 would, 3 x Retry-After for a GET, with the shared API thread parked).
The holder is started only once a read as that user is allowed and classified
by the test's FlowSchema (APF's and RBAC's caches lag their objects), reads
begin only after its headers are out, and a holder that reads show holds
nothing (another request took the seat first) is replaced within a second or
two. Adds ~3 s to the suite.
"""

import asyncio
import contextlib
import dataclasses
import logging
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, config

from cairn.operator import kubeapi, reconcile, runtime
from cairn.operator.core import tunables
from tests.integration.devcluster import kube_helpers as kh
from tests.integration.operator.conftest import SLEEP_FOREVER, Kube, job_body

pytestmark = pytest.mark.cluster

FLOWCONTROL = "flowcontrol.apiserver.k8s.io/v1"
SETTINGS = tunables.Settings(
    reconcile=tunables.Reconcile(
        error_retry_seconds=0.05, error_backoff_cap_seconds=0.1, error_jitter=0.5
    )
)
"""Backoff far below APF's Retry-After (>= 1 s): a longer wait is the header's doing."""
DEADLINE = 20.0
ASKED = re.compile(r"429 Too Many Requests, Retry-After (\d+) s")


@dataclasses.dataclass(frozen=True)
class Throttled:
    """The throttled user and the UID of the FlowSchema that sends it to its level."""

    name: str
    flow_schema_uid: str


@contextlib.contextmanager
def _throttled_user(kube: Kube) -> Iterator[Throttled]:
    """A user whose every request goes to a Reject-only, zero-concurrency level;
    it may edit the test namespace (so the request holding the seat is admitted)."""
    name = f"cairn-test-{kube.namespace}"
    flow = client.FlowcontrolApiserverV1Api(kube.api_client)
    flow.create_priority_level_configuration(
        {
            "apiVersion": FLOWCONTROL,
            "kind": "PriorityLevelConfiguration",
            "metadata": {"name": name},
            "spec": {
                "type": "Limited",
                "limited": {
                    "nominalConcurrencyShares": 0,
                    "lendablePercent": 0,
                    "borrowingLimitPercent": 0,
                    "limitResponse": {"type": "Reject"},
                },
            },
        }
    )
    rule = {"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"], "namespaces": ["*"]}
    try:
        schema = flow.create_flow_schema(
            {
                "apiVersion": FLOWCONTROL,
                "kind": "FlowSchema",
                "metadata": {"name": name},
                "spec": {
                    "priorityLevelConfiguration": {"name": name},
                    "matchingPrecedence": 100,
                    "rules": [
                        {
                            "subjects": [{"kind": "User", "user": {"name": name}}],
                            "resourceRules": [rule],
                        }
                    ],
                },
            }
        )
        kube.rbac.create_namespaced_role_binding(
            kube.namespace,
            {
                "metadata": {"name": "throttled-edit"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": "edit",
                },
                "subjects": [
                    {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": name}
                ],
            },
        )
        yield Throttled(name=name, flow_schema_uid=schema.metadata.uid)
    finally:
        with contextlib.suppress(client.ApiException):
            flow.delete_flow_schema(name)
        flow.delete_priority_level_configuration(name)


def _as_user(kube: Kube, user: str) -> tuple[int, str | None]:
    """One cheap read of the test namespace's ConfigMaps as ``user``: its status
    and the FlowSchema APF classified it by (a header of every response)."""
    url = f"{kube.api_client.configuration.host}/api/v1/namespaces/{kube.namespace}/configmaps"
    response = kube.api_client.rest_client.pool_manager.request(
        "GET", f"{url}?limit=1", headers={"Impersonate-User": user}, retries=False
    )
    return int(response.status), response.headers.get("X-Kubernetes-PF-FlowSchema-UID")


@dataclasses.dataclass
class _Holder:
    """One request of a user in flight, its body withheld until `stop`."""

    thread: threading.Thread
    release: threading.Event
    sent: threading.Event
    answered: list[int]

    def stop(self) -> None:
        self.release.set()
        self.thread.join(DEADLINE)


def _hold_seat(kube: Kube, user: str) -> _Holder:
    """Start a dry-run ConfigMap create as ``user`` whose body arrives only at `stop`."""
    release = threading.Event()
    sent = threading.Event()
    answered: list[int] = []

    def body() -> Iterator[bytes]:
        sent.set()  # asked for its body: the request line and headers are out
        yield b'{"apiVersion":"v1","kind":"ConfigMap",'
        release.wait(DEADLINE)  # bounded: the server gets its body in the end
        yield b'"metadata":{"generateName":"held-"}}'

    def hold() -> None:
        url = f"{kube.api_client.configuration.host}/api/v1/namespaces/{kube.namespace}/configmaps"
        response = kube.api_client.rest_client.pool_manager.request(
            "POST",
            f"{url}?dryRun=All",
            body=body(),
            chunked=True,
            headers={"Impersonate-User": user, "Content-Type": "application/json"},
            retries=False,
        )
        answered.append(response.status)

    thread = threading.Thread(target=hold, name="apf-seat-holder")
    thread.start()
    return _Holder(thread=thread, release=release, sent=sent, answered=answered)


def _refused_within(kube: Kube, user: str, *, seconds: float) -> bool:
    """Whether a read as ``user`` is answered 429 within ``seconds``."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        if _as_user(kube, user)[0] == 429:
            return True
        time.sleep(0.05)
    return False


@contextlib.contextmanager
def _seat_held(kube: Kube, throttled: Throttled) -> Iterator[None]:
    """One request of ``user`` in flight (its body withheld) until the block ends.

    Yields only once the seat is seen held (a read as ``user`` answered 429):
    under load the holder's thread may send after another request of the user
    took the level's one seat, and then the holder itself is refused and
    nothing is throttled (every later request admitted one at a time). Such
    a holder is replaced until one holds the seat (bounded)."""
    user = throttled.name
    # The RoleBinding and the FlowSchema reach the authorizer's and APF's caches
    # asynchronously (seconds under load): a holder refused 403 holds nothing,
    # and one classified before the FlowSchema counts holds a seat of the
    # catch-all level, not of the throttled one.
    ready = (200, throttled.flow_schema_uid)
    kh.wait_for(
        lambda: _as_user(kube, user) == ready, timeout=DEADLINE, what=f"RBAC and APF for {user}"
    )
    deadline = time.monotonic() + DEADLINE
    settle = 0.1
    while True:
        holder = _hold_seat(kube, user)
        # Read only once the holder's headers are out and the server had a moment
        # to admit it: a read sent first takes the level's one seat itself, and
        # the holder is refused.
        assert holder.sent.wait(DEADLINE), "the holder's request was never sent"
        time.sleep(settle)
        # A refused holder cannot tell: its thread sees the 429 only once its
        # withheld body is sent. Reads still admitted a while after it went out
        # mean it holds nothing; it is released and another one sent.
        if _refused_within(kube, user, seconds=1.0 + settle):
            break  # the seat is held: a read of the same user was refused
        holder.stop()
        assert time.monotonic() < deadline, f"no holder kept the seat: last {holder.answered}"
        settle = min(2 * settle, 2.0)  # a slower server gets longer to admit the next
    try:
        yield
    finally:
        holder.stop()
    assert holder.answered == [201], f"the seat holder's request was answered {holder.answered}"


@contextlib.contextmanager
def _api(kube: Kube, *, user: str | None) -> Iterator[kubeapi.KubeApi]:
    """A client configured as the operator's own (``handlers.configure``); its
    pooled connections closed at the end (an unclosed socket warns at GC)."""
    configuration = client.Configuration()
    config.load_kube_config(
        config_file=str(kube.handle.kubeconfig), client_configuration=configuration
    )
    configuration.retries = runtime.client_retries()
    api_client = client.ApiClient(configuration)
    if user is not None:
        api_client.set_default_header("Impersonate-User", user)
    try:
        yield kubeapi.KubeApi.of(api_client)
    finally:
        api_client.rest_client.pool_manager.clear()
        api_client.close()


async def _throttled_wait(
    state: runtime.Runtime, body: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> tuple[float, int]:
    """Reconcile until the server answers 429 (bounded); the wait drawn and the
    Retry-After the server sent."""
    key = (body["metadata"]["namespace"], body["metadata"]["name"])
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        caplog.clear()
        truth = reconcile.PodTruth(list_first=True)  # each try calls the API server
        answer = await state.reconcile_guarded(
            key, body=body, written=reconcile.Written(), truth=truth
        )
        found = ASKED.search(caplog.text)
        if found:
            assert answer is None
            return state.retry_wait(key), int(found.group(1))
        await asyncio.sleep(0.05)
    raise AssertionError(f"no 429 within {DEADLINE} s; last log: {caplog.text!r}")


def test_throttled_reconcile_waits_the_servers_retry_after(
    kube: Kube, caplog: pytest.LogCaptureFixture
) -> None:
    created = kube.create(job_body("throttled", script=SLEEP_FOREVER, suspend=True))
    bodies = [created] + [
        {**created, "metadata": {**created["metadata"], "name": f"throttled-{n}"}} for n in (1, 2)
    ]
    jitter = SETTINGS.reconcile.error_jitter

    async def main() -> None:
        with (
            _throttled_user(kube) as user,
            _api(kube, user=user.name) as throttled,
            _api(kube, user=None) as plain,
        ):
            state = runtime.Runtime(api=throttled, settings=SETTINGS)
            try:
                with _seat_held(kube, user):
                    waits = []
                    for body in bodies:
                        wait, asked = await _throttled_wait(state, body, caplog)
                        assert asked <= wait <= asked * (1 + jitter), (wait, asked)
                        waits.append(wait)
                    assert len(set(waits)) > 1, waits  # throttled together, back apart
                state.api = plain  # the server answers again
                key = (kube.namespace, "throttled")
                answer = await state.reconcile_guarded(
                    key, body=created, written=reconcile.Written(), truth=reconcile.PodTruth()
                )
                assert answer is not None and key not in state.failures
            finally:
                state.close()

    with caplog.at_level(logging.WARNING, logger="cairn.operator.runtime"):
        asyncio.run(main())
