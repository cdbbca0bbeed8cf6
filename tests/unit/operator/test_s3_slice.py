"""core.s3slice: a prefix listing in slices, pure decisions.

Covers, each a named case: a page within the pass's share lists the next
page, the pass's last page yields (the next pass goes on from the token),
the last page completes; the cap reached mid-slice (and on the first page,
and with no cap for the cleanup); the next pass counts as a slice and keeps
the token; a continuation token refused by the store restarts the listing
once, a second refusal (or a refused first page) is the store's error; the
back-off after capped listings doubles, is capped and jittered; the
deletion check: an unchanged folder stands, an object added or rewritten,
a manifest that appeared in a partial, a step gone (the prefix shrank) and
a manifest moved aside meanwhile are stale; listings in progress are kept
between passes within their budget, past it a listing goes on in its pass.
"""

import pytest

from cairn.operator.core import s3slice

MAX = 20_000


def page(
    progress: s3slice.Progress,
    *,
    contents: int = 1000,
    token: str | None = "t",
    in_pass: int = 1,
    per_pass: int = 2,
    max_keys: int | None = MAX,
) -> tuple[s3slice.Progress, s3slice.Next]:
    return s3slice.after_page(
        progress,
        contents=contents,
        next_token=token,
        pages_per_pass=per_pass,
        page_in_pass=in_pass,
        max_keys=max_keys,
    )


def test_page_within_the_share_lists_the_next() -> None:
    progress, then = page(s3slice.Progress(), token="t1", in_pass=1)
    assert then == "page"
    assert progress == s3slice.Progress(token="t1", keys=1000, pages=1, slices=1)


def test_last_page_of_the_share_yields_with_its_token() -> None:
    first, _ = page(s3slice.Progress(), token="t1", in_pass=1)
    progress, then = page(first, token="t2", in_pass=2)
    assert then == "yield"
    assert (progress.token, progress.keys, progress.pages) == ("t2", 2000, 2)


def test_last_page_of_the_listing_completes() -> None:
    progress, then = page(s3slice.Progress(), contents=7, token=None, in_pass=2)
    assert then == "complete" and progress.keys == 7 and progress.token is None


def test_complete_beats_yield_on_the_shares_last_page() -> None:
    assert page(s3slice.Progress(), token=None, in_pass=2)[1] == "complete"


def test_cap_reached_mid_slice() -> None:
    near = s3slice.Progress(token="t", keys=19_500, pages=20, slices=10)
    progress, then = page(near, contents=1000, token="t21", in_pass=1)
    assert then == "over_cap" and progress.keys == 20_500


def test_cap_reached_on_the_last_page_still_stops() -> None:
    near = s3slice.Progress(token="t", keys=19_500, pages=20, slices=10)
    assert page(near, contents=1000, token=None)[1] == "over_cap"


def test_exactly_the_cap_is_not_over_it() -> None:
    near = s3slice.Progress(token="t", keys=19_000, pages=19, slices=10)
    assert page(near, contents=1000, token=None)[1] == "complete"


def test_no_cap_for_the_cleanup_listing() -> None:
    huge = s3slice.Progress(token="t", keys=10**7)
    assert page(huge, token="u", max_keys=None, per_pass=10**9)[1] == "page"


def test_next_pass_takes_the_listing_up_as_a_slice() -> None:
    kept = s3slice.Progress(token="t2", keys=2000, pages=2, slices=1)
    going_on = s3slice.next_slice(kept)
    assert going_on.token == "t2" and going_on.keys == 2000 and going_on.slices == 2
    assert going_on.sliced and not kept.sliced


def test_refused_token_restarts_the_listing_once() -> None:
    kept = s3slice.Progress(token="expired", keys=4000, pages=4, slices=3)
    again = s3slice.on_refused_token(kept)
    assert again == s3slice.Progress(slices=3, restarts=1)
    assert again is not None and again.sliced  # still judged as a listing over passes


def test_second_refused_token_is_the_stores_error() -> None:
    restarted = s3slice.Progress(token="again-refused", keys=2000, pages=2, slices=4, restarts=1)
    assert s3slice.on_refused_token(restarted) is None


def test_refused_first_page_is_the_stores_error() -> None:
    assert s3slice.on_refused_token(s3slice.Progress()) is None


@pytest.mark.parametrize(
    ("capped", "expected"), [(1, 60.0), (2, 120.0), (3, 240.0), (7, 3600.0), (500, 3600.0)]
)
def test_back_off_after_capped_listings_doubles_up_to_its_cap(capped: int, expected: float) -> None:
    wait = s3slice.cap_backoff(capped=capped, base_seconds=60.0, cap_seconds=3600.0, draw=0.0)
    assert wait == expected


def test_back_off_is_jittered_down_by_at_most_a_quarter() -> None:
    wait = s3slice.cap_backoff(capped=1, base_seconds=60.0, cap_seconds=3600.0, draw=0.999)
    assert 45.0 <= wait < 60.0


def test_back_off_needs_a_capped_listing() -> None:
    with pytest.raises(ValueError, match="failures"):
        s3slice.cap_backoff(capped=0, base_seconds=60.0, cap_seconds=3600.0, draw=0.0)


SEEN = {
    10: {"manifest.json": (100, "e1"), "a1-x/model.pt": (5, "e2")},
    15: {"a2-x/model.pt": (5, "e3")},  # a manifest-less folder: an abandoned partial?
}


def stale(
    fresh: dict[int, dict[str, tuple[int, str]]],
    *,
    steps: tuple[int, ...] = (10, 15),
    fresh_aside: frozenset[int] = frozenset(),
) -> tuple[int, ...]:
    return s3slice.stale_steps(
        steps, seen=SEEN, fresh=fresh, seen_aside=frozenset(), fresh_aside=fresh_aside
    )


def test_unchanged_folders_keep_their_deletions() -> None:
    assert stale({10: dict(SEEN[10]), 15: dict(SEEN[15])}) == ()


def test_manifest_that_appeared_in_a_partial_is_stale() -> None:
    committed = {**SEEN[15], "manifest.json": (90, "e9")}
    assert stale({10: dict(SEEN[10]), 15: committed}) == (15,)


def test_object_rewritten_is_stale() -> None:
    rewritten = {**SEEN[10], "a1-x/model.pt": (5, "other")}
    assert stale({10: rewritten, 15: dict(SEEN[15])}) == (10,)


def test_step_gone_when_the_prefix_shrank_is_stale() -> None:
    assert stale({15: dict(SEEN[15])}) == (10,)


def test_manifest_moved_aside_meanwhile_is_stale() -> None:
    fresh = {10: dict(SEEN[10]), 15: dict(SEEN[15])}
    assert stale(fresh, fresh_aside=frozenset({15})) == (15,)


def test_only_the_steps_to_delete_are_compared() -> None:
    assert stale({10: dict(SEEN[10])}, steps=(10,), fresh_aside=frozenset({99})) == ()


def test_listing_may_be_kept_within_the_budget() -> None:
    assert s3slice.may_yield(mine=2000, held_elsewhere=98_000, budget=100_000)


def test_listing_past_the_budget_goes_on_in_its_pass() -> None:
    assert not s3slice.may_yield(mine=2000, held_elsewhere=98_001, budget=100_000)
