"""A prefix listed in slices against a real S3 server (SeaweedFS on loopback).

``s3observe.observe(..., sliced=True)`` as the operator's pass calls it,
with pages of two keys and one page per pass, so a few objects make a
listing of several slices (``core.s3slice``). Requests are counted with
botocore's event hooks on the very client. Covers:

- each pass lists one page and says the listing goes on; the pass that
  lists the last page judges the whole prefix (every step verified) and
  keeps the listing's view for the deletion check;
- the cap reached mid-slice: ``ListCapError`` naming the cap, the listing
  dropped, the capped count up; a listing that completes resets it;
- a continuation token the store refuses (injected: SeaweedFS takes any
  token as a start key, so it cannot refuse one) restarts the listing from
  the first page, once; refused again, the pass fails with the store's error;
- the deletion check lists the folders again: unchanged, nothing is stale;
  a manifest written meanwhile into a manifest-less folder makes it stale;
- listings held between passes past ``list_held_keys`` (another job's slot
  holds them): the pass lists on to the end instead of keeping its own.
"""

from __future__ import annotations

import pathlib
from typing import Any

import botocore.exceptions
import pytest

from cairn.devcluster import standalone_s3
from cairn.operator import s3list, s3observe
from cairn.operator.core import s3plan, tunables
from tests.integration.storage.test_s3_verify_retention import SMALL, Store

pytestmark = pytest.mark.s3

WHO = s3observe.Identity(job_uid=None)
SLICED = tunables.S3(list_page_keys=2, list_pages_per_pass=1)


@pytest.fixture(scope="module")
def bucket(s3_server: standalone_s3.S3Server) -> str:
    return s3_server.new_bucket("slices")  # one bucket, a prefix per test


@pytest.fixture
def store(s3_server: standalone_s3.S3Server, bucket: str, request: pytest.FixtureRequest) -> Store:
    return Store(s3_server, bucket, f"team/{request.node.name[:60]}")


class Lists:
    """Counts ListObjectsV2 calls; refuses the next ``refuse`` continued ones."""

    def __init__(self, s3: Any) -> None:
        self.calls = 0
        self.refuse = 0
        s3.meta.events.register("provide-client-params.s3.ListObjectsV2", self._call)

    def _call(self, params: dict[str, Any], **_: Any) -> None:
        self.calls += 1
        if self.refuse and "ContinuationToken" in params:
            self.refuse -= 1
            error: Any = {"Error": {"Code": "InvalidArgument", "Message": "token expired"}}
            raise botocore.exceptions.ClientError(error, "ListObjectsV2")


def one_pass(
    store: Store, caches: s3observe.Caches, bounds: tunables.S3 = SLICED
) -> s3plan.Observation | None:
    """One pass's observe: the observation, or None while the listing goes on."""
    try:
        return s3observe.observe(
            store.s3, store.target, caches=caches, who=WHO, bounds=bounds, sliced=True
        )
    except s3list.ListingGoesOnError:
        return None


def until_complete(store: Store, caches: s3observe.Caches) -> s3plan.Observation:
    """The passes until one judges the prefix (a few here: at most ten)."""
    for _ in range(10):
        seen = one_pass(store, caches)
        if seen is not None:
            return seen
    raise AssertionError("the listing did not complete in 10 passes")


def test_each_pass_lists_a_page_and_the_last_judges_all(
    store: Store, tmp_path: pathlib.Path
) -> None:
    for step in (7, 8):
        store.write_step(tmp_path, step, sizes=SMALL)  # 3 objects each: 3 pages of 2
    caches, lists = s3observe.Caches(), Lists(store.s3)
    assert one_pass(store, caches) is None and lists.calls == 1
    assert one_pass(store, caches) is None and lists.calls == 2
    seen = one_pass(store, caches)
    assert lists.calls == 3 and seen is not None
    assert sorted(seen.listing) == [7, 8]
    assert all(
        isinstance(m, s3plan.Checked) and m.verdict.verified for m in seen.manifests.values()
    )
    view = caches.listing.view
    assert view is not None and sorted(view.steps) == [7, 8]
    assert caches.listing.progress is None  # the next pass starts a new listing


def test_cap_reached_mid_slice_drops_the_listing(store: Store, tmp_path: pathlib.Path) -> None:
    store.write_step(tmp_path, 7, sizes=SMALL)
    capped = tunables.S3(list_page_keys=2, list_pages_per_pass=1, list_max_keys=2)
    caches = s3observe.Caches()
    assert one_pass(store, caches, capped) is None  # 2 keys: within the cap
    with pytest.raises(s3list.ListCapError, match=r"more than 2 objects.*list_max_keys"):
        one_pass(store, caches, capped)
    assert caches.listing.capped == 1 and caches.listing.progress is None
    assert caches.listing.steps == {}
    until_complete(store, caches)  # the cap lifted: a listing that completes
    assert caches.listing.capped == 0


def test_refused_token_restarts_the_listing_once(store: Store, tmp_path: pathlib.Path) -> None:
    store.write_step(tmp_path, 7, sizes=SMALL)
    caches, lists = s3observe.Caches(), Lists(store.s3)
    assert one_pass(store, caches) is None
    lists.refuse = 1
    assert one_pass(store, caches) is None  # refused, then the first page again
    assert lists.calls == 3 and caches.listing.progress is not None
    assert caches.listing.progress.restarts == 1
    seen = one_pass(store, caches)
    assert seen is not None and sorted(seen.listing) == [7]
    assert sorted(seen.listing[7]) == sorted(["manifest.json", *SMALL])


def test_refused_token_twice_is_the_stores_error(store: Store, tmp_path: pathlib.Path) -> None:
    store.write_step(tmp_path, 7, sizes=SMALL)
    caches, lists = s3observe.Caches(), Lists(store.s3)
    assert one_pass(store, caches) is None
    lists.refuse = 2
    assert one_pass(store, caches) is None  # refused: restarted, the first page
    with pytest.raises(s3observe.StoreError, match="InvalidArgument"):
        one_pass(store, caches)  # refused again in the same listing
    assert caches.listing.progress is None  # the next pass starts from scratch


def test_deletion_check_sees_a_manifest_written_meanwhile(
    store: Store, tmp_path: pathlib.Path
) -> None:
    store.write_step(tmp_path / "a", 7, sizes=SMALL)
    store.write_step(tmp_path / "b", 8, sizes=SMALL, commit=False)  # uploading: no manifest
    caches = s3observe.Caches()
    until_complete(store, caches)
    view = caches.listing.view
    assert view is not None and "manifest.json" not in view.steps[8]

    def stale() -> tuple[int, ...]:
        return s3list.stale_deletions(
            store.s3, store.target, view=view, steps=(7, 8), bounds=SLICED
        )

    assert stale() == ()
    store.s3.put_object(Bucket=store.bucket, Key=store.target.key(8, "manifest.json"), Body=b"{}")
    assert stale() == (8,)


def test_listing_goes_on_in_its_pass_past_the_held_budget(
    store: Store, tmp_path: pathlib.Path
) -> None:
    store.write_step(tmp_path, 7, sizes=SMALL)
    budget = tunables.S3(list_page_keys=2, list_pages_per_pass=1, list_held_keys=3)
    other, mine, lists = s3observe.Caches(), s3observe.Caches(), Lists(store.s3)
    assert one_pass(store, other, budget) is None  # the other job holds 2 objects
    seen = one_pass(store, mine, budget)  # 2 more would hold 4 > 3: listed to the end
    assert seen is not None and sorted(seen.listing) == [7] and lists.calls == 3
    del other  # a job dropped mid-listing: its slot no longer counts
    assert one_pass(store, s3observe.Caches(), budget) is None
