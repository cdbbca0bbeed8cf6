"""Listing of a job's S3 prefix: ListObjectsV2 pages, in slices over passes.

Blocking (boto3): call from a worker thread; reads only. ``s3observe``
judges what is listed here, ``s3apply.delete_prefix`` deletes it. Also the
store's shared vocabulary (``Target``, ``StoreError``, ``Deadline``), which
``s3observe`` re-exports so callers keep naming them there.

Bounds (issue 20; what a tenant's bucket holds is untrusted): a listing
stops with ``ListCapError`` past ``list_max_keys`` objects and checks its
``Deadline`` before each next page. The operator's pass lists at most
``list_pages_per_pass`` pages and keeps its place (continuation token, what
was listed so far) in the job's ``ListingSlot`` (decisions in
``core.s3slice``), while all listings held between passes stay within
``list_held_keys`` objects: a big prefix is listed over several passes, each
short. Deletions planned from such a listing are checked against the store
first (``stale_deletions``: each folder listed again). The module imports no
other S3 module of the operator's (``s3observe`` imports it).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
import typing
import weakref
from typing import Any

import botocore.exceptions

from cairn.api import checkpointspec
from cairn.api import manifest as manifest_mod
from cairn.operator.core import s3slice, tunables

if typing.TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client


class StoreError(Exception):
    """Reading or changing the prefix failed; the message carries no secrets."""


ERRORS = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)
"""What a boto3 call raises when the store or the network fails."""


def failure(what: str, error: Exception) -> StoreError:
    """A ``StoreError`` naming the call and the S3 error code (never a credential)."""
    if isinstance(error, botocore.exceptions.ClientError):
        code = error.response.get("Error", {}).get("Code", "?")
        return StoreError(f"{what} failed: {code}")
    return StoreError(f"{what} failed: {type(error).__name__}: {error}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Target:
    """The job's prefix: ``s3://bucket/prefix``."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, uri: str) -> Target:
        bucket, prefix = checkpointspec.split_s3_uri(uri)
        if not bucket or not uri.startswith("s3://"):
            raise StoreError(f"not an s3:// URI: {uri!r}")
        return cls(bucket=bucket, prefix=prefix)

    @property
    def base(self) -> str:
        """Key prefix of the job's objects, with a trailing slash (or empty)."""
        return f"{self.prefix}/" if self.prefix else ""

    def key(self, step: int, path: str) -> str:
        return f"{self.base}{manifest_mod.step_dir_name(step)}/{path}"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Listed:
    size: int
    etag: str


class Deadline:
    """When a pass stops starting S3 calls (monotonic seconds; None: never)."""

    def __init__(self, at: float | None = None, *, seconds: float = 0.0) -> None:
        self.at, self.seconds = at, seconds

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds, seconds=seconds)

    def check(self, what: str) -> None:
        """Raise ``StoreError`` before ``what`` once the deadline passed."""
        if self.at is not None and time.monotonic() >= self.at:
            raise StoreError(
                f"S3 pass stopped at its deadline ({self.seconds:g} s) before {what}:"
                " the store answers too slowly; the next pass goes on"
            )


NO_DEADLINE = Deadline()


class ListCapError(StoreError):
    """The prefix holds more than ``S3.list_max_keys`` objects (``s3pass`` backs off)."""


class ListingGoesOnError(Exception):
    """This pass listed its share of pages (``S3.list_pages_per_pass``); the job's
    next pass goes on from the token kept in its ``ListingSlot``."""


Steps = dict[int, dict[str, Listed]]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class View:
    """A listing read over several passes, kept for the pass that judges it so its
    deletions can be checked against the store first (``s3slice.stale_steps``)."""

    steps: Steps
    aside: frozenset[int]


@dataclasses.dataclass(kw_only=True, slots=True, weakref_slot=True, eq=False)
class ListingSlot:
    """One job's listing between passes (``core.s3slice``): where it stands and what it
    listed so far (at most ``list_max_keys`` objects, ~250 bytes each)."""

    progress: s3slice.Progress | None = None
    steps: Steps = dataclasses.field(default_factory=dict)
    aside: set[int] = dataclasses.field(default_factory=set)
    capped: int = 0
    """Listings in a row that reached ``list_max_keys`` (the back-off grows with it)."""
    view: View | None = None
    """The last completed listing, when it took several passes (for the deletion check)."""

    def restart(self) -> None:
        """Drop what was listed: the next page is the first."""
        self.progress, self.steps, self.aside = None, {}, set()


_HELD: weakref.WeakSet[ListingSlot] = weakref.WeakSet()
"""Slots that hold a listing between passes (a dropped job's slot leaves with it)."""
_HELD_LOCK = threading.Lock()


def _keep_between_passes(slot: ListingSlot, progress: s3slice.Progress, budget: int) -> bool:
    """Keep ``slot``'s listing for the next pass if all listings held stay within
    ``budget`` objects (``s3slice.may_yield``)."""
    with _HELD_LOCK:
        elsewhere = sum(s.progress.keys for s in _HELD if s is not slot and s.progress is not None)
        if not s3slice.may_yield(mine=progress.keys, held_elsewhere=elsewhere, budget=budget):
            return False
        slot.progress = progress
        _HELD.add(slot)
        return True


def list_steps(s3: S3Client, target: Target) -> Steps:
    """Every object under ``<prefix>/step-<N>/``, by step and relative path (no cap:
    the ``onDelete`` cleanup must see the whole prefix)."""
    return list_prefix(s3, target, max_keys=None)[0]


def _take(slot: ListingSlot, contents: list[Any], base: str) -> None:
    """Add one page's objects to ``slot``: step folders, and manifests moved aside."""
    for obj in contents:
        folder, _, path = obj["Key"][len(base) :].partition("/")
        if folder == ".cairn":
            parts = path.split("/")
            if len(parts) >= 2 and parts[-1] == manifest_mod.MANIFEST_NAME:
                moved = manifest_mod.parse_step_dir_name(parts[-2])
                if moved is not None:
                    slot.aside.add(moved)
            continue
        step = manifest_mod.parse_step_dir_name(folder)
        if step is None or not path:
            continue
        slot.steps.setdefault(step, {})[path] = Listed(
            size=int(obj.get("Size", 0)), etag=str(obj.get("ETag", ""))
        )


def _page(
    s3: S3Client, target: Target, *, sub: str, token: str | None, keys: int
) -> dict[str, Any]:
    """One ListObjectsV2 page of up to ``keys`` objects: the first, or the one
    ``token`` continues to."""
    bucket, prefix = target.bucket, target.base + sub
    if token is None:
        page = s3.list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=keys)
    else:
        page = s3.list_objects_v2(
            Bucket=bucket, Prefix=prefix, MaxKeys=keys, ContinuationToken=token
        )
    return typing.cast(dict[str, Any], page)


def list_prefix(
    s3: S3Client,
    target: Target,
    *,
    max_keys: int | None,
    deadline: Deadline = NO_DEADLINE,
    slot: ListingSlot | None = None,
    pages_per_pass: int | None = None,
    sub: str = "",
    page_keys: int = tunables.DEFAULT.s3.list_page_keys,
    held_keys: int = tunables.DEFAULT.s3.list_held_keys,
) -> tuple[Steps, frozenset[int]]:
    """``list_steps``, plus the steps named by a manifest moved aside under
    ``<prefix>/.cairn/<kind>/<tag>/step-<N>/manifest.json``. Past ``max_keys``
    objects it stops with ``ListCapError``: a tenant's prefix never costs the
    operator more memory than that. With ``slot`` and ``pages_per_pass``, it
    goes on from the slot's token and raises ``ListingGoesOnError`` after that many
    pages (``core.s3slice``); ``sub`` lists only ``<prefix>/<sub>``."""
    slot = slot if slot is not None else ListingSlot()
    progress = _resume(slot)
    where = f"s3://{target.bucket}/{target.base}{sub}"
    in_pass = 0
    while True:
        if in_pass:  # the pass checked its deadline before the first one
            deadline.check("the next page of the listing")
        page, progress = _fetch(
            s3, target, slot=slot, progress=progress, sub=sub, keys=page_keys, where=where
        )
        if page is None:
            continue  # a refused token: the listing from scratch
        in_pass += 1
        contents = page.get("Contents", [])
        progress, then = s3slice.after_page(
            progress,
            contents=len(contents),
            next_token=page.get("NextContinuationToken") if page.get("IsTruncated") else None,
            pages_per_pass=pages_per_pass or sys.maxsize,
            page_in_pass=in_pass,
            max_keys=max_keys,
        )
        if then == "over_cap":
            raise _over_cap(slot, where=where, max_keys=max_keys)
        _take(slot, contents, target.base)
        if then == "yield" and _keep_between_passes(slot, progress, held_keys):
            raise ListingGoesOnError(f"{where}: {progress.keys} objects listed so far")
        if then == "complete":
            return _complete(slot, sliced=progress.sliced)


def _resume(slot: ListingSlot) -> s3slice.Progress:
    """Where this pass's listing starts: the slot's next slice, else the first page.
    The slot keeps no progress while the pass lists (kept again when it yields)."""
    if slot.progress is None:
        slot.restart()
        progress = s3slice.Progress()
    else:
        progress = s3slice.next_slice(slot.progress)
    slot.progress, slot.view = None, None
    return progress


def _fetch(
    s3: S3Client,
    target: Target,
    *,
    slot: ListingSlot,
    progress: s3slice.Progress,
    sub: str,
    keys: int,
    where: str,
) -> tuple[dict[str, Any] | None, s3slice.Progress]:
    """The page ``progress`` is at, or None and the progress to list again from
    when the store refused a continuation token (``s3slice.on_refused_token``).
    Raises ``StoreError`` (the slot restarted) on any other failure."""
    try:
        return _page(s3, target, sub=sub, token=progress.token, keys=keys), progress
    except botocore.exceptions.ClientError as error:
        again = s3slice.on_refused_token(progress)
        slot.restart()
        if again is None:
            raise failure(f"listing {where}", error) from None
        return None, again
    except ERRORS as error:
        slot.restart()
        raise failure(f"listing {where}", error) from None


def _over_cap(slot: ListingSlot, *, where: str, max_keys: int | None) -> ListCapError:
    """The error for a prefix past ``max_keys``; the slot starts over and counts it."""
    slot.restart()
    slot.capped += 1
    return ListCapError(
        f"{where} holds more than {max_keys} objects"
        " (the operator's S3.list_max_keys): not verified, nothing deleted"
    )


def _complete(slot: ListingSlot, *, sliced: bool) -> tuple[Steps, frozenset[int]]:
    """A finished listing, taken out of the slot; kept as its ``view`` when it took
    several passes (for ``stale_deletions``)."""
    steps, aside = slot.steps, frozenset(slot.aside)
    slot.restart()
    slot.capped = 0
    if sliced:
        slot.view = View(steps=steps, aside=aside)
    return steps, aside


def stale_deletions(
    s3: S3Client, target: Target, *, view: View, steps: tuple[int, ...], bounds: tunables.S3
) -> tuple[int, ...]:
    """The steps to delete whose folder (or aside manifest) changed since the sliced
    listing ``view`` saw it: each folder and ``.cairn/`` listed again now.
    Raises ``StoreError``."""
    fresh: Steps = {}
    for step in steps:
        sub = f"{manifest_mod.step_dir_name(step)}/"
        fresh.update(
            list_prefix(
                s3, target, max_keys=bounds.list_max_keys, sub=sub, page_keys=bounds.list_page_keys
            )[0]
        )
    _, aside = list_prefix(
        s3, target, max_keys=bounds.list_max_keys, sub=".cairn/", page_keys=bounds.list_page_keys
    )
    return s3slice.stale_steps(
        steps, seen=view.steps, fresh=fresh, seen_aside=view.aside, fresh_aside=aside
    )
