"""reconcile.PodTruth: the pod cache corrected by a fresh list from the API.

Covers: a pod in the cache but not in a fresh list (after a delete found it
gone) is a ghost and is hidden from later cache reads; pods the list has
that the cache lacks are planned from; a ghost is forgotten once the cache
drops it; a fresh ``_PodTruth`` and one after a 404 delete ask for a list.
"""

from cairn.operator import reconcile

from . import jobs


def test_ghosts_are_hidden_until_the_cache_drops_them() -> None:
    truth = reconcile.PodTruth()
    assert truth.list_next, "the first reconcile lists from the API"
    ghost, live, fresh = jobs.pod(1, 0), jobs.pod(1, 1), jobs.pod(2, 0)
    planned = truth.from_list(cached=(ghost, live), listed=(live, fresh))
    assert planned == (live, fresh)
    assert truth.ghosts == {ghost.uid} and not truth.list_next
    assert truth.from_cache((ghost, live)) == (live,)
    assert truth.from_cache((live, fresh)) == (live, fresh)
    assert truth.ghosts == set()
