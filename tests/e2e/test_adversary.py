"""Issue #20's adversaries on the devcluster: a job answers only to its own.

Each case is a named test; docs/security.md (the threat model) names them.
Real parts throughout: the devcluster's API server (restricted Pod Security
where a case needs it), the shared operator, a private node agent enforcing
NetworkPolicy (`tests/e2e/fenced.py`), Kueue, real Ray and the real S3.

Pods with a job's labels (docs/security.md, "Pods with a job's labels"):

- ``test_strangers_neither_block_suspend_nor_die_with_the_job``: beside a
  running job, a decoy the operator never made (labels
  ``cairn.dev/job-name=<job>``, ``cairn.dev/attempt: "99"``,
  ``cairn.dev/rank: "0"``, an impossible nodeSelector, restricted
  securityContext, no ownerReference) and an impostor (the job as its
  controller ownerReference, a name the operator never gives): each is
  reported once (a Warning ``ForeignPod`` Event naming it); suspending the
  job still reaches Suspended with the job's own pods gone, both strangers
  untouched and not reported again; deleting the job with
  ``onDelete: Delete`` (its pods deleted and waited for before its S3 prefix
  is emptied) leaves the decoy alone;
- ``test_kueue_releases_the_quota_with_a_decoy_present``: a queued job
  suspended while admitted deactivates its Workload, and the operator still
  releases the quota with a decoy live.

The job's network boundary (docs/security.md, "The job's network
boundary"), the job's pods and an outsider (same namespace, no label of the
job) on the private node:

- ``test_rendezvous_port_admits_the_job_and_drops_an_outsider``: rank 0
  listens on ``MASTER_PORT`` (29500, torchrun's rendezvous store); rank 1
  connects, the outsider's connects are dropped and never get through;
- ``test_ray_ports_admit_the_job_and_drop_an_outsider``: a real
  ``runtime: ray`` job; every TCP port its head listens on outside loopback
  once its driver runs (the GCS port 6379 among them; Ray's client server,
  10001, runs only where ``ray[client]`` is installed, and is then one of
  them) is reached by a task on the worker pod and dropped for the outsider;
  a decoy with the job's label passes the policy (accepted, see the docs) and
  its GCS client without the token gets ``InvalidAuthToken``.

Ray token auth (docs/security.md, "Ray token auth"), against a real head
started by the launcher with a pod's env (`tests/integration/ray/tokenhead.py`)
and clients in processes of their own:

- ``test_a_ray_client_without_a_token_is_refused`` and
  ``test_a_ray_client_with_a_wrong_token_is_refused``: ``InvalidAuthToken``;
- ``test_a_ray_client_with_the_jobs_token_works``: the GCS lists the head
  node and a ``ray.init()`` client runs a task;
- ``test_the_ray_token_is_never_in_the_launchers_output``.

Where the operator sends requests (docs/security.md, "Prefixes" and "Where
the operator sends requests"), on the real S3:

- ``test_prefix_nested_in_an_owned_prefix_is_refused``: ``PrefixNested``
  naming the outer job, no call under the inner prefix, the outer keeps it;
- ``test_loopback_endpoint_is_refused_with_a_generic_message``: an endpoint
  that is a name for loopback, with the chart's default settings (an S3
  pass run in this process): ``EndpointAddressRefused`` with the generic
  message, no address in status or Event, the detail in the operator log,
  and the real S3 behind the name got nothing.

The 16 MiB manifest and 100,000-object prefix beside 200 healthy jobs is a
bench (docs/security.md, "One tenant's store cannot take the operator down").
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import logging
import pathlib
import secrets
import urllib.parse
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes.client.rest import ApiException

from cairn.api import podenv, trainingjob
from cairn.devcluster import kueue
from cairn.operator import egress, kubeapi, prefixapply, s3observe, s3pass
from cairn.operator.core import egressplan, jobobserve, podowner, prefixplan
from cairn.operator.core import kueueplan as protocol
from tests.conftest import DevclusterHandle, OperatorProcess
from tests.e2e import fenced
from tests.integration.devcluster import kube_helpers as kh
from tests.integration.operator import kueue_helpers as kq
from tests.integration.operator.conftest import (
    GROUP,
    LABEL_JOB,
    PLURAL,
    SLEEP_FOREVER,
    VERSION,
    WAIT,
    Kube,
    job_body,
)
from tests.integration.ray import tokenhead
from tests.integration.storage import prefixenv
from tests.integration.storage.test_storage_operator import _suspended_job, keys

pytestmark = [pytest.mark.e2e, pytest.mark.cluster]


@pytest.fixture
def kube(devcluster: DevclusterHandle, operator: OperatorProcess) -> Iterator[Kube]:
    """A fresh namespace, as the operator tests' `kube`."""
    for namespace in kh.temp_namespace(devcluster.core, "adv"):
        yield Kube(devcluster, namespace)


# --- pods with a job's labels ------------------------------------------------------

RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted"}
SECRET = "s3-creds"


def _stranger(
    name: str, *, job: str, rank: str, owner: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A pod the operator never made, with the job's labels; it never schedules."""
    metadata: dict[str, Any] = {
        "name": name,
        "labels": {LABEL_JOB: job, "cairn.dev/attempt": "99", "cairn.dev/rank": rank},
    }
    if owner is not None:
        metadata["ownerReferences"] = [owner]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {
            "nodeSelector": {"cairn.dev/no-such-node": "true"},
            "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [
                {
                    "name": "trainer",
                    "image": "cairn-trainer:dev",
                    "command": ["python", "-c", SLEEP_FOREVER],
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
        },
    }


def _controller(job: dict[str, Any]) -> dict[str, Any]:
    """The job as controller ownerReference (no blockOwnerDeletion: any pod creator may)."""
    meta = job["metadata"]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainingJob",
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
    }


def _untouched(kube: Kube, name: str) -> None:
    pod = kube.core.read_namespaced_pod(name, kube.namespace)
    assert pod.metadata.deletion_timestamp is None, f"{name} is being deleted"


def _reports(kube: Kube, job: str, pod: str) -> list[Any]:
    return [
        e
        for e in kube.events(job)
        if e.reason == podowner.REASON_FOREIGN_POD and e.message.startswith(f"pod {pod} ")
    ]


@pytest.fixture
def bucket(kube: Kube) -> Iterator[str]:
    """An empty bucket, and the Secret with the devcluster's S3 key pair."""
    creds = kube.handle.s3_credentials
    name = f"foreign-{uuid.uuid4().hex[:10]}"
    s3: Any = kube.handle.target.s3_client()
    s3.create_bucket(Bucket=name)
    kube.core.create_namespaced_secret(
        kube.namespace,
        kh.s3_secret(SECRET, access_key=creds.access_key, secret_key=creds.secret_key),
    )
    try:
        yield name
    finally:
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=name)
        for page in pages:
            for item in page.get("Contents", []):
                s3.delete_object(Bucket=name, Key=item["Key"])
        s3.delete_bucket(Bucket=name)


@pytest.mark.timeout(600)
def test_strangers_neither_block_suspend_nor_die_with_the_job(kube: Kube, bucket: str) -> None:
    kube.core.patch_namespace(kube.namespace, {"metadata": {"labels": RESTRICTED}})
    checkpoint = {
        "upload": {
            "uri": f"s3://{bucket}/run",
            "endpoint": kube.handle.s3_pod_endpoint,
            "credentialsSecretRef": {"name": SECRET},
        },
        "onDelete": "Delete",
    }
    job = kube.create(job_body("owned", script=SLEEP_FOREVER, checkpoint=checkpoint))
    kube.wait_phase("owned", "Running", attempt=1)
    kube.wait_pods_running("owned", attempt=1, count=2)

    decoy = _stranger("decoy", job="owned", rank="0")
    impostor = _stranger("impostor", job="owned", rank="1", owner=_controller(job))
    for body in (decoy, impostor):
        kube.core.create_namespaced_pod(kube.namespace, body)  # restricted admission passes it
    kube.wait_event("owned", podowner.REASON_FOREIGN_POD, contains="pod decoy ")
    kube.wait_event("owned", podowner.REASON_FOREIGN_POD, contains="pod impostor ")

    # Both ranks stay; the job is not frozen by an "attempt 99" ahead of its status.
    kube.patch_spec("owned", {"suspend": True})
    status = kube.wait_phase("owned", "Suspended", timeout=WAIT)
    assert status["attempt"] == 1
    kh.wait_for(lambda: not kube.pods("owned", attempt=1), timeout=WAIT, what="own pods gone")
    for name in ("decoy", "impostor"):
        _untouched(kube, name)
        [report] = _reports(kube, "owned", name)  # once, though many reconciles ran since
        assert report.type == "Warning" and report.count == 1
        assert "ignored" in report.message
    assert "no controller ownerReference" in _reports(kube, "owned", "decoy")[0].message
    assert "owned-a99-n1" in _reports(kube, "owned", "impostor")[0].message

    # onDelete: Delete deletes the job's pods (and waits for them) before the
    # S3 cleanup; the decoy is not the job's and stays.
    kube.custom.delete_namespaced_custom_object(GROUP, VERSION, kube.namespace, PLURAL, "owned")

    def job_gone() -> bool:
        try:
            kube.job("owned")
        except ApiException as error:
            if error.status == 404:
                return True
            raise
        return False

    kh.wait_for(job_gone, timeout=WAIT, what="the job deleted")
    _untouched(kube, "decoy")


@pytest.fixture
def qkube(kube: Kube) -> Iterator[Kube]:
    """`kube` with the devcluster's Kueue up and queues in the namespace; drained after."""
    kq.kueue_ready(kube.handle.target)
    kueue.ensure_queues(
        kube.handle.target, namespace=kube.namespace, quota={"cpu": "1", "memory": "1Gi"}
    )
    yield kube
    kq.drain(kube.api_client, kube.namespace)


@pytest.mark.timeout(600)
def test_kueue_releases_the_quota_with_a_decoy_present(qkube: Kube) -> None:
    requests = {"requests": {"cpu": "500m", "memory": "64Mi"}}
    qkube.create(kq.queued(job_body("queued", script=SLEEP_FOREVER, resources=requests)))
    qkube.wait_phase("queued", "Running", attempt=1)
    qkube.core.create_namespaced_pod(qkube.namespace, _stranger("decoy", job="queued", rank="0"))
    qkube.wait_event("queued", podowner.REASON_FOREIGN_POD, contains="pod decoy ")

    qkube.patch_spec("queued", {"suspend": True})
    qkube.wait_phase("queued", "Suspended")
    kq.wait_workload(
        qkube.api_client,
        qkube.namespace,
        "queued",
        lambda w: w["spec"].get("active") is False and "admission" not in (w.get("status") or {}),
        what="inactive with its quota released",
    )
    # Released by the operator (a fresh list of the job's own pods found none).
    qkube.wait_event("queued", protocol.REASON_QUOTA_RELEASED)
    _untouched(qkube, "decoy")


# --- the job's network boundary ------------------------------------------------------

RAY_CLIENT_PORT = 10001
RAY_WAIT = 240.0
"""Bound of a Ray job's start on the shared 2-core machine (head, worker, driver)."""


def _ray_ports_expected() -> set[int]:
    """The GCS port, and Ray's client server where ``ray[client]`` (grpcio) is
    installed: ``ray start --head`` starts it only then (the devcluster's pods
    run this venv, whose ``ray`` extra has no grpcio)."""
    client_server = importlib.util.find_spec("grpc") is not None
    return {podenv.RAY_PORT_DEFAULT, *([RAY_CLIENT_PORT] if client_server else [])}


@pytest.fixture
def private_node(devcluster: DevclusterHandle, tmp_path: pathlib.Path) -> Iterator[str]:
    with fenced.private_node(devcluster, tmp_path / "agent.log") as name:
        yield name


def test_rendezvous_port_admits_the_job_and_drops_an_outsider(
    kube: Kube, private_node: str
) -> None:
    job = "fenced-rdzv"
    try:
        kube.create(
            job_body(
                job, script=fenced.RENDEZVOUS_RANKS, nodes=2, template=fenced.on_node(private_node)
            )
        )
        pods = kube.wait_pods_running(job, attempt=1, count=2)
        rank0, rank1 = sorted(pods, key=lambda p: p.metadata.labels["cairn.dev/rank"])
        assert rank0.spec.node_name == rank1.spec.node_name == private_node
        kh.wait_for(
            lambda: "hello" in fenced.logged(kube, rank1, "result"),
            timeout=WAIT,
            what="rank 1 to reach rank 0's rendezvous port",
        )
        port = podenv.MASTER_PORT_DEFAULT
        outsider = fenced.start_outsider(
            kube, target=rank0.status.pod_ip, ports=[port], node=private_node
        )
        fenced.wait_dropped(kube, outsider, [port])
    finally:
        fenced.remove_all(kube, job)


@pytest.mark.timeout(600)
def test_ray_ports_admit_the_job_and_drop_an_outsider(kube: Kube, private_node: str) -> None:
    job = "fenced-ray"
    body = job_body(
        job,
        script=fenced.RAY_DRIVER,
        nodes=2,
        runtime="ray",
        ray={"numCpus": 1, "objectStoreMemoryBytes": 80 * 1024 * 1024},
        template=fenced.on_node(private_node),
    )
    try:
        kube.create(body)
        pods = kube.wait_pods_running(job, attempt=1, count=2)
        head = next(p for p in pods if p.metadata.labels["cairn.dev/rank"] == "0")
        listed = fenced.wait_logged(
            kube, head, "head-ports", timeout=RAY_WAIT, what="the driver to list the head's ports"
        )
        ports: list[int] = json.loads(listed)
        assert _ray_ports_expected() <= set(ports), ports
        reached = fenced.wait_logged(
            kube, head, "worker-reached", timeout=RAY_WAIT, what="a task on the worker to connect"
        )
        assert json.loads(reached) == {str(port): "connected" for port in ports}
        outsider = fenced.start_outsider(
            kube, target=head.status.pod_ip, ports=ports, node=private_node
        )
        decoy = fenced.start_ray_decoy(
            kube,
            job=job,
            target=head.status.pod_ip,
            port=podenv.RAY_PORT_DEFAULT,
            node=private_node,
        )
        fenced.wait_dropped(kube, outsider, ports)
        # The job's label lets a decoy through the policy (docs/security.md:
        # accepted); the job's token still keeps it out of Ray.
        refusal = fenced.wait_logged(kube, decoy, "decoy gcs", timeout=WAIT, what="the decoy")
        assert fenced.logged(kube, decoy, "decoy tcp") == ["connected"]
        assert "InvalidAuthToken" in refusal, refusal
    finally:
        fenced.remove_all(kube, job)


# --- Ray token auth ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tokenhead.Head]:
    with tokenhead.running(tmp_path_factory.mktemp("ray-auth")) as head:
        yield head


@pytest.mark.timeout(300)
def test_a_ray_client_without_a_token_is_refused(ray_head: tokenhead.Head) -> None:
    tokenhead.assert_refused(tokenhead.probe(ray_head, "gcs", {"RAY_AUTH_MODE": "disabled"}))


@pytest.mark.timeout(300)
def test_a_ray_client_with_a_wrong_token_is_refused(ray_head: tokenhead.Head) -> None:
    wrong = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    tokenhead.assert_refused(tokenhead.probe(ray_head, "gcs", wrong))


@pytest.mark.timeout(300)
def test_a_ray_client_with_the_jobs_token_works(ray_head: tokenhead.Head) -> None:
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(ray_head.token_file)}
    assert tokenhead.probe(ray_head, "gcs", auth) == {"ok": True, "nodes": 1}
    assert tokenhead.probe(ray_head, "init", auth) == {"ok": True, "answer": 42}


def test_the_ray_token_is_never_in_the_launchers_output(ray_head: tokenhead.Head) -> None:
    assert ray_head.token not in ray_head.log.read_text(errors="replace")


# --- where the operator sends requests -----------------------------------------------------


@pytest.fixture
def env(devcluster: DevclusterHandle, operator: OperatorProcess) -> Iterator[prefixenv.Env]:
    with prefixenv.prepared(devcluster) as found:
        yield found


def test_prefix_nested_in_an_owned_prefix_is_refused(env: prefixenv.Env) -> None:
    """Issue #20.6: the outer job keeps its prefix; the inner one is refused, naming it."""
    env.create(_suspended_job("outer", checkpoint={"upload": env.upload()}))
    kh.wait_for(lambda: env.claim("outer").get("owned") is True, timeout=WAIT, what="outer's claim")
    inner_uri = f"s3://{env.bucket}/shared/run/inner"
    env.create(_suspended_job("inner", checkpoint={"upload": env.upload(uri=inner_uri)}))
    refused = env.wait_refused("inner", "PrefixNested")
    assert f"inside the prefix s3://{env.bucket}/shared/run/" in refused["message"]
    assert f"TrainingJob {env.namespace}/outer" in refused["message"]
    assert keys(env.s3, env.bucket, "shared/run/inner/") == set()  # no owner object, no call
    assert env.claim("outer").get("owned") is True


def test_loopback_endpoint_is_refused_with_a_generic_message(
    env: prefixenv.Env, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue #20.5, with the chart's default settings (no allow-list), run in this
    process: the endpoint is a name for the devcluster's real S3 on loopback, so a
    missing gate would have claimed the prefix there."""
    monkeypatch.setattr(prefixapply, "settings", prefixplan.Settings)
    port = urllib.parse.urlsplit(env.devcluster.s3_endpoint).port
    body = _suspended_job(
        "loop", checkpoint={"upload": env.upload(endpoint=f"http://localhost:{port}")}
    )
    body["spec"]["managedBy"] = "kueue.x-k8s.io/multikueue"  # the shared operator stays out
    env.create(body)
    raw = env.job("loop")
    job = jobobserve.parse_job(raw)
    assert isinstance(job, trainingjob.TrainingJob)
    with caplog.at_level(logging.WARNING, logger=egress.LOG.name):
        s3pass.storage_pass(
            api=kubeapi.KubeApi.of(env.devcluster.api_client),
            raw=raw,
            job=job,
            caches=s3observe.Caches(),
            now=lambda: datetime.datetime.now(datetime.UTC),
        )
    assert env.claim("loop") == {
        "owned": False,
        "reason": prefixplan.REASON_ADDRESS,
        "message": egressplan.REFUSED_MESSAGE,
    }
    status = json.dumps(env.job("loop")["status"])
    assert "127.0.0.1" not in status and "::1" not in status and "lastError" not in status
    assert keys(env.s3, env.bucket, "") == set()  # the real S3 behind the name got nothing
    assert "localhost resolves to" in caplog.text  # the detail: the operator log only
    (event,) = env.events("loop", prefixplan.REASON_ADDRESS)
    assert event.type == "Warning" and "127.0.0.1" not in event.message
