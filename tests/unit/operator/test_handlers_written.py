"""reconcile.Written: which copy of the job a reconcile plans from.

Covers: after our status patch, the watch's view is stale while it shows the
version the patch replaced *or any version before ours* (kopf's finalizer or
diff-base annotation patch lands between the two: planning from it decided
and announced a transition twice on the devcluster); once the watch shows
our version or a newer one, it is the truth again; resourceVersions that are
not integers fall back to the exact-match rule.
"""

from typing import Any

from cairn.operator import reconcile


def _job(version: str, phase: str) -> dict[str, Any]:
    return {"metadata": {"resourceVersion": version}, "status": {"phase": phase}}


def _written(replaced: str, ours: str) -> Any:
    written = reconcile.Written()
    written.replaced = replaced
    written.body = _job(ours, "Suspended")
    return written


def test_nothing_written_plans_from_the_watch() -> None:
    live = _job("10", "Pending")
    assert reconcile.Written().freshest(live) is live


def test_the_replaced_version_is_stale() -> None:
    written = _written("10", "12")
    assert written.freshest(_job("10", "Pending"))["status"]["phase"] == "Suspended"


def test_a_version_between_the_replaced_one_and_ours_is_stale() -> None:
    written = _written("10", "12")
    assert written.freshest(_job("11", "Pending"))["status"]["phase"] == "Suspended"


def test_our_version_or_newer_is_the_truth() -> None:
    written = _written("10", "12")
    newer = _job("13", "Running")
    assert written.freshest(newer) is newer
    # …and stays so: an older copy is never preferred again once the watch caught up.
    assert written.body is None
    again = _job("14", "Running")
    assert written.freshest(again) is again


def test_opaque_versions_fall_back_to_the_exact_match() -> None:
    written = _written("a", "c")
    assert written.freshest(_job("a", "Pending"))["status"]["phase"] == "Suspended"
    other = _job("b", "Pending")
    assert written.freshest(other) is other
