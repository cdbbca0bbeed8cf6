"""End to end: the manifests in `examples/` run as they are on the devcluster.

Covers, with the shared operator process and real pods, each example applied
unchanged except for its name's namespace and its bucket (every S3 endpoint
is the devcluster's S3 as pods reach it): `hello-pod.yaml` (a plain Pod that
meets the restricted Pod Security Standard) exits 0 with its output;
`minimal.yaml` (the <= 20-line example) and `emptydir-s3.yaml` reach
Succeeded with the last step committed and uploaded (emptydir-s3: remote
retention kept its every-20th step); `managed-suspend.yaml`, handed to
another controller (`spec.managedBy`), is left alone: no pod and no status
once the operator has reconciled a later job in the same namespace. The
other examples, the two Python scripts included, are accounted for (`ELSEWHERE`): run by their own e2e tests
or documented as needing an earlier run; a new example file that is in
neither table fails `test_every_example_is_run_or_accounted_for`.
"""

import pathlib
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client

from tests import demo
from tests.integration.devcluster import kube_helpers

EXAMPLES = pathlib.Path(demo.REPO / "examples")
JOB_TIMEOUT_S = 300
POD_TIMEOUT_S = 120

ELSEWHERE = {
    "quickstart.yaml": "tests/e2e/test_quickstart.py (through a SIGKILLed rank)",
    "quickstart-ray.yaml": "tests/e2e/test_ray.py",
    "pvc-resume.yaml": "documented: runs after a job committed step 100 on its PVC (its header)",
    "user_trainer.py": "tests/e2e/test_user_script.py (a user's script as a TrainingJob)",
    "hf_trainer.py": "tests/e2e/test_transformers_trainer.py",
}


def _load(example: str) -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load((EXAMPLES / example).read_text())
    return body


@pytest.fixture
def namespace(devcluster: Any) -> Iterator[tuple[str, str]]:
    """(namespace, bucket): restricted namespace, its bucket and the cairn-demo-s3 Secret."""
    namespace, bucket = f"ex-{uuid.uuid4().hex[:8]}", f"ex-{uuid.uuid4().hex[:10]}"
    demo.prepare_namespace(
        api_client=devcluster.api_client,
        target=devcluster.target,
        namespace=namespace,
        bucket=bucket,
    )
    yield namespace, bucket
    devcluster.core.delete_namespace(namespace)


def _run_job(devcluster: Any, namespace: str, bucket: str, example: str) -> dict[str, Any]:
    body = _load(example)
    upload = body["spec"]["checkpoint"]["upload"]
    assert upload["endpoint"] == devcluster.target.s3_pod_endpoint  # reachable from pods
    upload["uri"] = upload["uri"].replace("s3://cairn-demo/", f"s3://{bucket}/")
    job = demo.run_job(
        api_client=devcluster.api_client,
        namespace=namespace,
        body=body,
        kill_rank_after_commit=None,
        on_row=lambda _row: None,
        timeout=JOB_TIMEOUT_S,
    )
    status: dict[str, Any] = job["status"]
    assert status["phase"] == "Succeeded", status
    return status


def check_hello_pod(devcluster: Any, namespace: str, bucket: str) -> None:
    body = _load("hello-pod.yaml")
    devcluster.core.create_namespaced_pod(namespace, body)
    name = body["metadata"]["name"]

    def finished() -> str | None:
        phase = kube_helpers.pod_phase(devcluster.core, name, namespace)
        return phase if phase in ("Succeeded", "Failed") else None

    phase = kube_helpers.wait_for(
        finished, timeout=POD_TIMEOUT_S, what=f"pod {namespace}/{name} to finish"
    )
    assert phase == "Succeeded"
    # The client turns the log into the repr of bytes unless asked for the raw body.
    raw = devcluster.core.read_namespaced_pod_log(name, namespace, _preload_content=False)
    log = raw.data.decode()
    assert log.startswith(f"hello from {name} on ") and "working 5/5" in log, log


def check_minimal(devcluster: Any, namespace: str, bucket: str) -> None:
    checkpoints = _run_job(devcluster, namespace, bucket, "minimal.yaml")["checkpoints"]
    assert checkpoints["lastCommitted"]["step"] == 20
    assert checkpoints["lastUploaded"]["step"] == 20


def check_emptydir_s3(devcluster: Any, namespace: str, bucket: str) -> None:
    checkpoints = _run_job(devcluster, namespace, bucket, "emptydir-s3.yaml")["checkpoints"]
    assert checkpoints["lastCommitted"]["step"] == 40
    assert checkpoints["lastUploaded"]["step"] == 40
    listing = demo.s3_listing(devcluster.target, bucket=bucket, prefix="emptydir-s3")
    assert {"step-000000020", "step-000000040"} <= set(listing), sorted(listing)


def check_managed_suspend(devcluster: Any, namespace: str, bucket: str) -> None:
    custom = client.CustomObjectsApi(devcluster.api_client)
    body = _load("managed-suspend.yaml")
    custom.create_namespaced_custom_object(demo.GROUP, demo.VERSION, namespace, demo.PLURAL, body)
    # A job Cairn manages, created after it: once the operator has reconciled
    # this one (Suspended, no pods), it has seen the example too.
    sentinel = _load("minimal.yaml")
    sentinel["metadata"]["name"] = "sentinel"
    sentinel["spec"]["suspend"] = True
    custom.create_namespaced_custom_object(
        demo.GROUP, demo.VERSION, namespace, demo.PLURAL, sentinel
    )
    kube_helpers.wait_for(
        lambda: (
            demo.get_job(custom, namespace, "sentinel").get("status", {}).get("phase")
            == "Suspended"
        ),
        timeout=60,
        what="the operator to reconcile the sentinel job",
    )
    example = demo.get_job(custom, namespace, body["metadata"]["name"])
    assert example["spec"]["suspend"] is True
    assert not example.get("status"), example["status"]
    pods = devcluster.core.list_namespaced_pod(namespace)
    assert pods.items == []


RUN: dict[str, Callable[[Any, str, str], None]] = {
    "hello-pod.yaml": check_hello_pod,
    "minimal.yaml": check_minimal,
    "emptydir-s3.yaml": check_emptydir_s3,
    "managed-suspend.yaml": check_managed_suspend,
}


def test_every_example_is_run_or_accounted_for() -> None:
    files = {p.name for p in EXAMPLES.iterdir() if p.suffix in (".yaml", ".py")}
    assert files == set(RUN) | set(ELSEWHERE)
    assert not set(RUN) & set(ELSEWHERE)
    assert len((EXAMPLES / "minimal.yaml").read_text().splitlines()) <= 20


@pytest.mark.e2e
@pytest.mark.cluster
@pytest.mark.parametrize("example", list(RUN))
def test_example_runs(
    devcluster: Any, operator: Any, namespace: tuple[str, str], example: str
) -> None:
    RUN[example](devcluster, *namespace)
