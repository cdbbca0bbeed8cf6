"""A prefix listing in slices: one S3 pass lists a few pages, the next goes on. Pure.

Why (issue 20, ``bench/tenant_scale.py``): a tenant's prefix of 100,000
objects listed up to ``list_max_keys`` in one pass held one of the S3
threads for 6-11 s (and, on a store not yet proven, every pass on it), and a
first pass cannot know a prefix is big. So a pass lists at most
``S3.list_pages_per_pass`` pages, keeps the ListObjectsV2 continuation
token in the job's state (``s3list.ListingSlot``) and gives its thread
back; ``s3loop`` re-queues the job at once, behind the passes already due,
and its next pass goes on from the token. The listing is judged (verify,
retention) only once complete.

Edge cases, decided here:

- the cap reached (in any slice): the listing ends with the same error as
  before (``lastError`` names ``list_max_keys``), what was listed is
  dropped, and the next full attempt waits ``cap_backoff`` (exponential in
  the attempts that reached the cap in a row);
- a continuation token the store refuses or has expired: the listing
  restarts from the first page, once; a second refusal in the same listing
  is the store's error;
- a listing read in several slices may be stale by the time it completes
  (the writer committed, moved a manifest aside, rotated a step): before any
  deletion, each step to delete is listed again with ``.cairn/``
  (``stale_steps``); one difference and the pass deletes nothing and the
  listing restarts from scratch;
- the job deleted mid-listing: ``s3loop`` drops the job with its caches, the
  slot with them;
- many big prefixes at once: what listings in progress hold between passes
  is bounded by ``S3.list_held_keys`` all together (``may_yield``); past it
  a listing goes on in the pass it is in (as before slices, so at most one
  whole listing per S3 thread).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Mapping
from typing import Literal

from cairn.operator.core import backoff

Next = Literal["page", "yield", "complete", "over_cap"]
"""After a page: list the next page now, give the thread back (the next pass goes
on), judge the complete listing, or stop at the cap."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Progress:
    """Where a listing stands between pages and between passes."""

    token: str | None = None
    """The continuation token of the next page; None: the first page."""
    keys: int = 0
    """Objects listed so far in this listing."""
    pages: int = 0
    """Pages listed so far in this listing."""
    slices: int = 1
    """Passes this listing has taken so far (the one running included)."""
    restarts: int = 0
    """Times this listing restarted after a refused continuation token."""

    @property
    def sliced(self) -> bool:
        """Whether the listing spans passes (so it may be stale when judged)."""
        return self.slices > 1


def after_page(
    progress: Progress,
    *,
    contents: int,
    next_token: str | None,
    pages_per_pass: int,
    page_in_pass: int,
    max_keys: int | None,
) -> tuple[Progress, Next]:
    """The progress after a page of ``contents`` objects and what comes next. Pure.

    ``next_token``: the page's ``NextContinuationToken`` (None: the last page);
    ``page_in_pass``: pages listed in this pass, this one included;
    ``max_keys``: None lists without a cap (the ``onDelete`` cleanup).
    """
    seen = Progress(
        token=next_token,
        keys=progress.keys + contents,
        pages=progress.pages + 1,
        slices=progress.slices,
        restarts=progress.restarts,
    )
    if max_keys is not None and seen.keys > max_keys:
        return seen, "over_cap"
    if next_token is None:
        return seen, "complete"
    if page_in_pass >= pages_per_pass:
        return seen, "yield"
    return seen, "page"


def may_yield(*, mine: int, held_elsewhere: int, budget: int) -> bool:
    """Whether a listing holding ``mine`` objects may keep them between passes while
    the other listings in progress hold ``held_elsewhere``. Pure."""
    return mine + held_elsewhere <= budget


def next_slice(progress: Progress) -> Progress:
    """The same listing, taken up by the job's next pass. Pure."""
    return dataclasses.replace(progress, slices=progress.slices + 1)


def on_refused_token(progress: Progress) -> Progress | None:
    """A continued page refused by the store: the listing from scratch (once), or
    None when it restarted before (then the refusal is the store's error). Pure."""
    if progress.token is None or progress.restarts >= 1:
        return None
    return Progress(slices=progress.slices, restarts=progress.restarts + 1)


def cap_backoff(*, capped: int, base_seconds: float, cap_seconds: float, draw: float) -> float:
    """Seconds before the next full listing of a prefix whose last ``capped``
    listings in a row (>= 1) reached ``list_max_keys``: ``base_seconds`` doubling,
    at most ``cap_seconds``, jittered by ``draw`` in [0, 1). Pure."""
    policy = backoff.Policy(base_seconds=base_seconds, cap_seconds=cap_seconds, jitter=0.25)
    return backoff.delay(policy, failures=capped, draw=draw)


def stale_steps(
    steps: Iterable[int],
    *,
    seen: Mapping[int, Mapping[str, Hashable]],
    fresh: Mapping[int, Mapping[str, Hashable]],
    seen_aside: frozenset[int],
    fresh_aside: frozenset[int],
) -> tuple[int, ...]:
    """The steps among ``steps`` (to be deleted) whose folder differs now from what
    the sliced listing saw (objects added, gone or rewritten: compared by path
    and what ``seen`` holds, e.g. size and ETag), or whose manifest was moved
    aside meanwhile. Empty: the deletions stand. Pure."""
    changed: list[int] = []
    for step in steps:
        moved = (step in fresh_aside) != (step in seen_aside)
        if moved or dict(seen.get(step, {})) != dict(fresh.get(step, {})):
            changed.append(step)
    return tuple(changed)
