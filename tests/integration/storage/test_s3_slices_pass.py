"""The operator's pass over a listing in slices, on the devcluster (real API server, real S3).

``s3pass.storage_pass`` as the operator runs it (the job's Secret read, the
prefix claimed, listed, judged, retention applied, the status patched), with
pages of two keys and one page per pass, for a job with ``keepLast: 2`` and
three committed steps (so retention deletes step 10). The job says
``managedBy`` another controller, so the shared operator leaves it alone.
Covers:

- each pass but the last lists a page and writes nothing (``goes_on``);
- a step folder changed between slices (an object written into step 10
  where the listing had passed: ``.a-late`` sorts before ``.metadata``, in
  the first page): the pass that completes the listing deletes nothing and
  starts the listing over;
- the listing read again deletes step 10 (the manifest and the files it
  lists; the late object, which no manifest lists, stays) and records it.
"""

from __future__ import annotations

import contextlib
import datetime
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest

from cairn.api import trainingjob
from cairn.operator import prefixapply, s3observe, s3pass
from cairn.operator.core import jobobserve, tunables
from tests.conftest import DevclusterHandle
from tests.integration.devcluster import kube_helpers as kh
from tests.integration.storage.test_storage_operator import GROUP, PLURAL, VERSION, write_step
from tests.integration.storage.test_tenant_caps import Tenant

pytestmark = pytest.mark.cluster

SLICED = tunables.S3(list_page_keys=2, list_pages_per_pass=1)
NAME = "sliced"


@pytest.fixture
def tenant(
    devcluster: DevclusterHandle, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Tenant]:
    monkeypatch.setenv("CAIRN_S3_ENDPOINT_ALLOWLIST", devcluster.s3_endpoint)
    # The settings are read from the environment once per process: not this
    # test's for the tests after it.
    prefixapply.settings.cache_clear()
    with contextlib.contextmanager(kh.temp_namespace)(devcluster.core, prefix="slices") as ns:
        made = Tenant(devcluster, ns, tmp_path)
        try:
            yield made
        finally:
            made.drop()
            prefixapply.settings.cache_clear()


def one_pass(tenant: Tenant, caches: s3observe.Caches) -> s3pass.PassResult:
    raw: dict[str, Any] = tenant.custom.get_namespaced_custom_object(
        GROUP, VERSION, tenant.namespace, PLURAL, NAME
    )
    job = jobobserve.parse_job(raw)
    assert isinstance(job, trainingjob.TrainingJob)
    return s3pass.storage_pass(
        api=tenant.api,
        raw=raw,
        job=job,
        caches=caches,
        now=lambda: datetime.datetime.now(datetime.UTC),
        bounds=SLICED,
    )


def exists(tenant: Tenant, step: int, path: str) -> bool:
    key = f"runs/{NAME}/step-{step:09d}/{path}"
    return bool(tenant.s3.list_objects_v2(Bucket=tenant.bucket, Prefix=key).get("KeyCount"))


def test_sliced_listing_changed_meanwhile_deletes_nothing(tenant: Tenant) -> None:
    made = tenant.create(NAME)
    retention = {"spec": {"checkpoint": {"retention": {"remote": {"keepLast": 2}}}}}
    tenant.custom.patch_namespaced_custom_object(
        GROUP, VERSION, tenant.namespace, PLURAL, NAME, retention
    )
    for step in (10, 20, 30):
        write_step(tenant.opts(NAME), tenant.tmp / str(step), step, job_uid=made["metadata"]["uid"])
    caches = s3observe.Caches()
    first = one_pass(tenant, caches)
    assert first.goes_on and first.patch is None and first.deleted == ()
    # The first page held .cairn/owner.json and step 10's .metadata: this one sorts
    # between them, where the listing has passed.
    late = f"runs/{NAME}/step-000000010/.a-late"
    tenant.s3.put_object(Bucket=tenant.bucket, Key=late, Body=b"x")
    for _ in range(40):  # the slices of this listing: each lists a page, writes nothing
        result = one_pass(tenant, caches)
        if caches.listing.progress is None:
            break
        assert result.goes_on and result.patch is None
    # The listing completed with step 10 changed since it was listed: nothing deleted.
    assert result.goes_on and result.deleted == () and result.patch is None
    assert exists(tenant, 10, "manifest.json")
    for _ in range(40):  # listed again from scratch, unchanged now: retention applies
        result = one_pass(tenant, caches)
        if not result.goes_on:
            break
    assert result.deleted == (10,) and result.error is None
    assert not exists(tenant, 10, "manifest.json") and exists(tenant, 10, ".a-late")
    assert tenant.status(NAME)["storage"]["remoteSteps"] == [20, 30]
