"""handlers: which jobs keep a reconcile daemon, the resync spread, pod expectations.

Covers: the daemon filter (``_live``) holds for every phase but Succeeded and
Failed (and for a job without status); ``finished`` reads only the status
phase; a resync sleep is ``resync_seconds`` shortened by at most
``resync_jitter``; ``_PodTruth`` awaits the pods the last apply created until
the cache shows all of them or the expectation runs out, and a job's first
daemon reconcile plans from the pod cache (no list).
"""

from typing import Any

import pytest

from cairn.operator import handlers, reconcile
from cairn.operator.core import tunables

from . import jobs


@pytest.mark.parametrize(
    ("phase", "live"),
    [
        (None, True),
        ("Pending", True),
        ("Starting", True),
        ("Running", True),
        ("Restarting", True),
        ("Suspending", True),
        ("Suspended", True),
        ("Succeeded", False),
        ("Failed", False),
    ],
)
def test_daemon_only_for_jobs_that_did_not_finish(phase: str | None, live: bool) -> None:
    raw: dict[str, Any] = jobs.body()
    if phase is not None:
        raw["status"] = {"phase": phase}
    assert handlers._live(raw) is live  # type: ignore[arg-type]
    assert handlers.finished(raw) is not live


def test_finished_ignores_a_malformed_status() -> None:
    assert not handlers.finished({"status": "Succeeded"})
    assert not handlers.finished({})


def test_resync_is_spread_within_the_jitter() -> None:
    settings = tunables.Reconcile(resync_seconds=60.0, resync_jitter=0.1)
    assert reconcile.resync_wait(settings, draw=lambda: 0.0) == 60.0
    assert reconcile.resync_wait(settings, draw=lambda: 0.999) == pytest.approx(54.006)
    assert reconcile.resync_wait(tunables.Reconcile(resync_jitter=0.0), draw=lambda: 0.5) == 60.0


def test_created_pods_are_awaited_until_the_cache_shows_them() -> None:
    truth = reconcile.PodTruth(list_first=False)
    assert not truth.list_next, "a daemon's first reconcile plans from the pod cache"
    n0, n1 = jobs.pod(1, 0), jobs.pod(1, 1)
    truth.expect([n0.name, n1.name], until=10.0)
    assert truth.awaited((n0,), now=1.0) == {n1.name}
    assert truth.awaited((n0, n1), now=2.0) == frozenset()
    assert truth.expected == frozenset(), "met: nothing awaited any more"
    assert truth.awaited((), now=3.0) == frozenset()


def test_expectation_runs_out() -> None:
    truth = reconcile.PodTruth()
    truth.expect(["demo-a1-n0"], until=10.0)
    assert truth.awaited((), now=9.9) == {"demo-a1-n0"}
    assert truth.awaited((), now=10.0) == frozenset()


def test_reconcile_tunables_refuse_bad_values() -> None:
    with pytest.raises(ValueError, match=r"Reconcile\.resync_jitter"):
        tunables.Reconcile(resync_jitter=1.0)
    with pytest.raises(ValueError, match=r"Reconcile\.expectation_seconds"):
        tunables.Reconcile(expectation_seconds=0.0)
    with pytest.raises(ValueError, match=r"Lifecycle\.suspend_requeue_seconds"):
        tunables.Lifecycle(suspend_requeue_seconds=0.0)
    with pytest.raises(ValueError, match=r"S3\.client_cache_entries"):
        tunables.S3(client_cache_entries=0)
