"""The operator's S3 caps against a real S3 server (SeaweedFS on loopback).

Steps are written with the writer's own upload code (``Store`` of
``test_s3_verify_retention``), then ``s3observe.observe`` judges them as the
operator's pass does (``who``: the job's identity). Requests are counted
with botocore's event hooks on the very client. Covers:

- a manifest over ``manifest_max_bytes`` by its listed size is refused
  unread (no GET), the step kept as failed with the reason naming the cap;
- a manifest that grew after the listing is read by a bounded range (the
  store sends at most the cap plus one byte) and refused;
- a manifest listing more files than ``manifest_max_entries`` is refused;
- a prefix with more objects than ``list_max_keys`` stops the pass with a
  ``StoreError`` naming the cap (nothing judged);
- verdicts, not manifests, are cached: a second pass over unchanged steps
  GETs no manifest and heads no file; a data file rewritten gets its step
  judged again (and failed), the other step stays cached;
- a pass past its deadline stops before its next S3 call.
"""

from __future__ import annotations

import pathlib
import time
from typing import Any

import pytest

from cairn.devcluster import standalone_s3
from cairn.operator import s3observe
from cairn.operator.core import s3plan, tunables
from tests.integration.storage.test_s3_verify_retention import SMALL, Store

pytestmark = pytest.mark.s3

WHO = s3observe.Identity(job_uid=None)
"""Judged as the plan judges without identity: every manifest taken as the job's."""


@pytest.fixture(scope="module")
def bucket(s3_server: standalone_s3.S3Server) -> str:
    return s3_server.new_bucket("caps")  # one bucket (~2 s each), a prefix per test


@pytest.fixture
def store(s3_server: standalone_s3.S3Server, bucket: str, request: pytest.FixtureRequest) -> Store:
    return Store(s3_server, bucket, f"team/{request.node.name[:60]}")


class Calls:
    """The S3 operations the client sends, and the GET bodies' lengths."""

    def __init__(self, s3: Any) -> None:
        self.ops: list[str] = []
        self.got: list[int] = []
        s3.meta.events.register("before-call.s3", self._call)
        s3.meta.events.register("after-call.s3.GetObject", self._got)

    def _call(self, model: Any, **_: Any) -> None:
        self.ops.append(model.name)

    def _got(self, parsed: dict[str, Any], **_: Any) -> None:
        self.got.append(int(parsed.get("ContentLength", 0)))

    def count(self, op: str) -> int:
        return self.ops.count(op)


def judge(store: Store, **kw: Any) -> s3plan.Observation:
    return s3observe.observe(store.s3, store.target, who=WHO, **kw)


def verdict(seen: s3plan.Observation, step: int) -> s3plan.Verdict:
    read = seen.manifests[step]
    assert isinstance(read, s3plan.Checked)
    return read.verdict


def put_manifest(store: Store, step: int, size: int) -> None:
    key = store.target.key(step, "manifest.json")
    store.s3.put_object(Bucket=store.bucket, Key=key, Body=b"{" + b" " * (size - 2) + b"}")


def test_manifest_over_the_byte_cap_is_refused_unread(store: Store) -> None:
    put_manifest(store, 7, 3 * 1024 * 1024)
    calls = Calls(store.s3)
    bounds = tunables.S3(manifest_max_bytes=1024 * 1024)
    found = verdict(judge(store, bounds=bounds), 7)
    assert not found.verified
    assert "3145728 bytes, over the operator's limit of 1048576" in found.reason
    assert calls.count("GetObject") == 0


def test_manifest_grown_after_the_listing_is_read_bounded(store: Store) -> None:
    put_manifest(store, 7, 3 * 1024 * 1024)
    calls = Calls(store.s3)
    bounds = tunables.S3(manifest_max_bytes=1024 * 1024)
    read = s3observe.read_manifest(store.s3, store.target, 7, listed_size=100, bounds=bounds)
    assert isinstance(read, s3plan.ManifestError) and "over the operator's limit" in read.message
    assert calls.got == [1024 * 1024 + 1]  # the range: the cap plus one byte, no more


def test_manifest_with_too_many_entries_is_refused(store: Store, tmp_path: pathlib.Path) -> None:
    store.write_step(tmp_path, 7, sizes=SMALL)  # two files
    found = verdict(judge(store, bounds=tunables.S3(manifest_max_entries=1)), 7)
    assert not found.verified
    assert "lists 2 files, over the operator's limit of 1" in found.reason


def test_prefix_over_the_key_cap_stops_the_pass(store: Store, tmp_path: pathlib.Path) -> None:
    store.write_step(tmp_path, 7, sizes=SMALL)  # three objects
    calls = Calls(store.s3)
    with pytest.raises(s3observe.StoreError, match=r"more than 2 objects.*list_max_keys"):
        judge(store, bounds=tunables.S3(list_max_keys=2))
    assert calls.count("GetObject") == calls.count("HeadObject") == 0


def test_unchanged_steps_are_judged_once(store: Store, tmp_path: pathlib.Path) -> None:
    store.write_step(tmp_path, 7, sizes=SMALL)
    store.write_step(tmp_path, 8, sizes=SMALL)
    caches = s3observe.Caches()
    first = judge(store, caches=caches)
    assert verdict(first, 7).verified and verdict(first, 8).verified
    calls = Calls(store.s3)
    again = judge(store, caches=caches)
    assert verdict(again, 7).verified and verdict(again, 8).verified
    assert calls.count("GetObject") == calls.count("HeadObject") == 0
    store.s3.put_object(
        Bucket=store.bucket, Key=store.target.key(8, ".metadata"), Body=b"other bytes"
    )
    changed = judge(store, caches=caches)
    assert verdict(changed, 7).verified and not verdict(changed, 8).verified
    assert calls.count("GetObject") == 1  # step 8's manifest only


def test_pass_past_its_deadline_stops_before_its_next_call(
    store: Store, tmp_path: pathlib.Path
) -> None:
    store.write_step(tmp_path, 7, sizes=SMALL)
    late = s3observe.Deadline(time.monotonic() - 1.0, seconds=3.0)
    calls = Calls(store.s3)
    with pytest.raises(s3observe.StoreError, match=r"deadline \(3 s\)"):
        judge(store, deadline=late)
    assert calls.ops == ["ListObjectsV2"]
