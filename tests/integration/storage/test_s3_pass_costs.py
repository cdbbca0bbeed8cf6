"""What an S3 pass costs, against the devcluster's real API server and real S3 (issue 11).

The passes run in this test process (``s3pass.storage_pass``, and
``s3loop.S3Loop`` for the schedule), so their calls can be counted: S3
requests through a botocore event hook on the very client the pass uses
(``s3observe.CLIENTS``), passes through the loop's own counter. Covers:

- an unchanged manifest is not read again: a second pass over three
  committed steps GETs no manifest and heads no file (only the LIST and the
  owner object's GET); a new step costs exactly its own manifest GET;
- a rotated credentials Secret rebuilds the client: two passes with one key
  pair build one client; a Secret changed to a wrong secret key builds a
  new one and the store's refusal shows in ``status.storage.lastError``;
  back to the right pair, the first client is reused and the error clears;
- a finished job gets exactly one final pass: a job whose status says
  Succeeded is passed once (its steps verified in ``status.storage``), then
  leaves the schedule (its later events and an hour of schedule time bring
  no pass); a spec change (``retention.remote.keepLast: 1``) brings one more
  final pass, which applies the retention in S3, and then none.

A shared operator may work on the same job meanwhile (it verifies the same
objects); nothing here counts its calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import pathlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from cairn.api import trainingjob
from cairn.checkpoint import options
from cairn.operator import kubeapi, prefixapply, s3loop, s3observe, s3pass
from cairn.operator.core import jobobserve, prefixplan
from tests.conftest import DevclusterHandle, OperatorProcess
from tests.integration.devcluster import kube_helpers as kh
from tests.integration.storage.test_storage_operator import (
    GROUP,
    PLURAL,
    SECRET,
    VERSION,
    WAIT,
    _suspended_job,
    keys,
    write_step,
)

pytestmark = pytest.mark.cluster
NAME = "costs"


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class Store:
    """A bucket with committed steps, the job's Secret, and the job (suspended)."""

    def __init__(self, devcluster: DevclusterHandle, namespace: str, tmp: pathlib.Path) -> None:
        self.devcluster, self.namespace, self.tmp = devcluster, namespace, tmp
        self.api = kubeapi.KubeApi.of(devcluster.api_client)
        self.custom = client.CustomObjectsApi(devcluster.api_client)
        creds = devcluster.s3_credentials
        self.bucket = f"costs-{uuid.uuid4().hex[:10]}"
        self.opts = options.S3Options(
            uri=f"s3://{self.bucket}/runs/{NAME}",
            endpoint_url=devcluster.s3_endpoint,
            region="us-east-1",
            access_key=creds.access_key,
            secret_key=creds.secret_key,
        )
        self.s3: Any = devcluster.target.s3_client()
        self.s3.create_bucket(Bucket=self.bucket)

    def secret(self, secret_key: str) -> None:
        """Create or replace the credentials Secret (same access key, this secret key)."""
        body = client.V1Secret(
            metadata=client.V1ObjectMeta(name=SECRET),
            string_data={
                "AWS_ACCESS_KEY_ID": self.opts.access_key or "",
                "AWS_SECRET_ACCESS_KEY": secret_key,
            },
        )
        try:
            self.devcluster.core.create_namespaced_secret(self.namespace, body)
        except client.ApiException as error:
            if error.status != 409:
                raise
            self.devcluster.core.replace_namespaced_secret(SECRET, self.namespace, body)

    def create_job(self) -> None:
        upload = {
            "uri": self.opts.uri,
            "endpoint": self.devcluster.s3_endpoint,
            "credentialsSecretRef": {"name": SECRET},
        }
        body = _suspended_job(NAME, checkpoint={"intervalSteps": 5, "upload": upload})
        self.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, body)

    def uid(self) -> str:
        return str(self.raw()["metadata"]["uid"])

    def raw(self) -> dict[str, Any]:
        got: dict[str, Any] = self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, NAME
        )
        return got

    def job(self, raw: dict[str, Any]) -> trainingjob.TrainingJob:
        parsed = jobobserve.parse_job(raw)
        assert isinstance(parsed, trainingjob.TrainingJob)
        return parsed

    def one_pass(self, caches: s3observe.Caches) -> s3pass.PassResult:
        raw = self.raw()
        return s3pass.storage_pass(
            api=self.api, raw=raw, job=self.job(raw), caches=caches, now=_now
        )

    def client(self) -> Any:
        upload = self.job(self.raw()).spec.checkpoint.upload
        assert upload is not None
        return s3observe.CLIENTS.get(
            upload, access_key=self.opts.access_key, secret_key=self.opts.secret_key
        )

    def drop(self) -> None:
        for key in keys(self.s3, self.bucket, ""):
            self.s3.delete_object(Bucket=self.bucket, Key=key)
        self.s3.delete_bucket(Bucket=self.bucket)


@pytest.fixture
def store(
    devcluster: DevclusterHandle, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Store]:
    # A cache of this test's own, so that client builds are this test's.
    monkeypatch.setattr(s3observe, "CLIENTS", s3observe.ClientCache())
    # The operator's S3 settings as the devcluster's operator runs (tests/demo.py):
    # its S3, on loopback, allow-listed (else refused, docs/security.md).
    listed = prefixplan.Settings(endpoint_allow_list=(devcluster.s3_endpoint,))
    monkeypatch.setattr(prefixapply, "settings", lambda: listed)
    with contextlib.contextmanager(kh.temp_namespace)(devcluster.core, prefix="s3cost") as ns:
        made = Store(devcluster, ns, tmp_path)
        try:
            yield made
        finally:
            made.drop()


class Calls:
    """S3 operations a client sends, by operation name and key (a botocore hook)."""

    def __init__(self, s3: Any) -> None:
        self.s3 = s3
        self.seen: list[tuple[str, str]] = []

    def _record(self, params: dict[str, Any], model: Any, **_: Any) -> None:
        self.seen.append((model.name, str(params.get("Key", ""))))

    def __enter__(self) -> Calls:
        self.s3.meta.events.register("provide-client-params.s3", self._record)
        return self

    def __exit__(self, *_: object) -> None:
        self.s3.meta.events.unregister("provide-client-params.s3", self._record)

    def count(self, operation: str, suffix: str = "") -> int:
        return sum(1 for op, key in self.seen if op == operation and key.endswith(suffix))


def test_unchanged_manifest_is_not_read_again(store: Store) -> None:
    store.secret(store.opts.secret_key or "")
    store.create_job()  # first: its steps record its UID
    for step in (10, 20, 30):
        write_step(store.opts, store.tmp, step, job_uid=store.uid())
    caches = s3observe.Caches()
    with Calls(store.client()) as calls:
        first = store.one_pass(caches)
        assert first.plan is not None and first.plan.verified_steps == (10, 20, 30)
        assert calls.count("GetObject", "manifest.json") == 3
        heads = calls.count("HeadObject")
        assert heads > 0
        calls.seen.clear()

        second = store.one_pass(caches)
        assert second.plan is not None and second.plan.verified_steps == (10, 20, 30)
        assert calls.count("GetObject", "manifest.json") == 0
        assert calls.count("HeadObject") == 0
        assert calls.count("ListObjectsV2") == 1
        calls.seen.clear()

        write_step(store.opts, store.tmp, 40, job_uid=store.uid())
        third = store.one_pass(caches)
        assert third.plan is not None and third.plan.verified_steps == (10, 20, 30, 40)
        got = [key for op, key in calls.seen if op == "GetObject" and key.endswith("manifest.json")]
        assert got == [f"runs/{NAME}/step-000000040/manifest.json"]
    assert s3observe.CLIENTS.builds == 1


def test_rotated_secret_rebuilds_the_client(store: Store) -> None:
    right = store.opts.secret_key or ""
    store.secret(right)
    store.create_job()
    write_step(store.opts, store.tmp, 10, job_uid=store.uid())
    caches = s3observe.Caches()
    assert store.one_pass(caches).error is None
    assert store.one_pass(caches).error is None
    assert s3observe.CLIENTS.builds == 1

    store.secret(right + "-rotated-wrong")
    refused = store.one_pass(caches)
    assert s3observe.CLIENTS.builds == 2
    assert refused.error is not None and "SignatureDoesNotMatch" in refused.error
    assert (store.raw().get("status") or {})["storage"]["lastError"] == refused.error

    store.secret(right)
    healed = store.one_pass(caches)
    assert healed.error is None
    assert s3observe.CLIENTS.builds == 2, "the first pair's client is still cached"
    assert "lastError" not in (store.raw().get("status") or {})["storage"]


def test_finished_job_gets_exactly_one_final_pass(store: Store, operator: OperatorProcess) -> None:
    store.secret(store.opts.secret_key or "")
    store.create_job()
    for step in (10, 20, 30):
        write_step(store.opts, store.tmp, step, job_uid=store.uid())
    # The shared operator records Suspended first; after that it leaves the phase alone.
    kh.wait_for(
        lambda: (store.raw().get("status") or {}).get("phase") == "Suspended",
        timeout=WAIT,
        what="the operator to record Suspended",
    )
    store.custom.patch_namespaced_custom_object_status(
        GROUP,
        VERSION,
        store.namespace,
        PLURAL,
        NAME,
        {"status": {"phase": "Succeeded"}},
        _content_type="application/merge-patch+json",
    )
    key = (store.namespace, NAME)
    clock = [0.0]

    async def real_pass(
        _: s3loop.Key,
        raw: dict[str, Any],
        job: trainingjob.TrainingJob,
        caches: s3observe.Caches,
    ) -> s3pass.PassResult:
        return await asyncio.to_thread(
            s3pass.storage_pass, api=store.api, raw=raw, job=job, caches=caches, now=_now
        )

    loop = s3loop.S3Loop(run_pass=real_pass, monotonic=lambda: clock[0])

    def advance_and_run(seconds: float) -> list[s3loop.Key]:
        clock[0] += seconds
        return asyncio.run(loop.run_due())

    loop.update(key, store.raw())
    assert advance_and_run(2.0) == [key]
    assert loop.passes[(key, "final")] == 1
    assert (store.raw().get("status") or {})["storage"]["verifiedStep"] == 30
    # Its later events (the status patch of that pass, a kick) and time: no pass.
    loop.update(key, store.raw())
    kicked = store.raw()
    kicked.setdefault("status", {})["checkpoints"] = {"lastUploaded": {"step": 30}}
    loop.update(key, kicked)
    assert not loop.scheduled(key)
    assert advance_and_run(3600.0) == []

    # A spec change: one more final pass, which applies the new retention.
    store.custom.patch_namespaced_custom_object(
        GROUP,
        VERSION,
        store.namespace,
        PLURAL,
        NAME,
        {"spec": {"checkpoint": {"retention": {"remote": {"keepLast": 1}}}}},
        _content_type="application/merge-patch+json",
    )
    changed = store.raw()
    assert changed["metadata"]["generation"] == 2
    loop.update(key, changed)
    assert advance_and_run(2.0) == [key]
    assert advance_and_run(3600.0) == []
    assert loop.passes[(key, "final")] == 2 and loop.passes[(key, "periodic")] == 0
    steps = {k.split("/")[2] for k in keys(store.s3, store.bucket, f"runs/{NAME}/")}
    assert steps == {"step-000000030", ".cairn"}
