"""podcache.PodCache: every job's pods from the operator's own list + watch.

Covers: a watch event notifies the job only when what its plan reads changed
(a kubelet patch of an annotation does not; a phase change or a deletion
does); a re-list replaces what the watch missed (a pod deleted while it was
away is dropped, its job notified) and leaves jobs with the same pods
unnotified; a namespace's re-list leaves other namespaces alone; a pod
whose job label changes moves to the other job (both notified); pods
without Cairn's attempt/rank labels are not kept; ``--namespace`` with a
pattern instead of a name is refused before the operator starts.
"""

from typing import Any

import pytest

from cairn.operator import __main__ as operator_main
from cairn.operator import podcache
from cairn.operator.core import names

NS = "team"


def _pod(
    job: str, attempt: int, rank: int, *, phase: str = "Pending", ns: str = NS, **meta: Any
) -> dict[str, Any]:
    labels = {
        names.LABEL_JOB: job,
        names.LABEL_ATTEMPT: str(attempt),
        names.LABEL_RANK: str(rank),
    }
    return {
        "metadata": {
            "name": f"{job}-a{attempt}-n{rank}",
            "namespace": ns,
            "uid": f"{ns}-{job}-{attempt}-{rank}",
            "labels": labels,
            **meta,
        },
        "status": {"phase": phase},
    }


class _Notes:
    def __init__(self) -> None:
        self.keys: list[tuple[str, str]] = []

    def __call__(self, key: tuple[str, str]) -> None:
        self.keys.append(key)

    def take(self) -> set[tuple[str, str]]:
        taken, self.keys = set(self.keys), []
        return taken


def test_only_changes_the_plan_reads_notify_the_job() -> None:
    notes = _Notes()
    cache = podcache.PodCache(notes)
    cache.apply("ADDED", _pod("a", 1, 0))
    assert notes.take() == {(NS, "a")}
    assert [p.name for p in cache.get((NS, "a"))] == ["a-a1-n0"]
    cache.apply("MODIFIED", _pod("a", 1, 0, annotations={"kubelet": "noise"}))
    assert notes.take() == set(), "nothing the plan reads changed"
    cache.apply("MODIFIED", _pod("a", 1, 0, phase="Running"))
    assert notes.take() == {(NS, "a")}
    assert [p.phase for p in cache.get((NS, "a"))] == ["Running"]
    cache.apply("DELETED", _pod("a", 1, 0, phase="Running"))
    assert notes.take() == {(NS, "a")}
    assert tuple(cache.get((NS, "a"))) == () and len(cache) == 0


def test_a_relist_drops_pods_the_watch_missed_and_notifies_only_changed_jobs() -> None:
    notes = _Notes()
    cache = podcache.PodCache(notes)
    cache.replace(None, [_pod("a", 1, 0), _pod("a", 1, 1), _pod("b", 1, 0)])
    assert notes.take() == {(NS, "a"), (NS, "b")}
    # a-a1-n1 was deleted while the watch was away: no DELETED event ever came.
    cache.replace(None, [_pod("a", 1, 0), _pod("b", 1, 0)])
    assert notes.take() == {(NS, "a")}
    assert [p.rank for p in cache.get((NS, "a"))] == [0]
    cache.replace(None, [_pod("b", 1, 0)])
    assert notes.take() == {(NS, "a")}
    assert tuple(cache.get((NS, "a"), ())) == ()


def test_a_namespace_relist_leaves_other_namespaces_alone() -> None:
    notes = _Notes()
    cache = podcache.PodCache(notes)
    cache.replace("x", [_pod("a", 1, 0, ns="x")])
    cache.replace("y", [_pod("a", 1, 0, ns="y")])
    notes.take()
    cache.replace("x", [])
    assert notes.take() == {("x", "a")}
    assert tuple(cache.get(("x", "a"))) == ()
    assert [p.name for p in cache.get(("y", "a"))] == ["a-a1-n0"]


def test_a_relabelled_pod_moves_to_its_new_job() -> None:
    notes = _Notes()
    cache = podcache.PodCache(notes)
    cache.apply("ADDED", _pod("a", 1, 0))
    notes.take()
    moved = _pod("a", 1, 0)
    moved["metadata"]["labels"][names.LABEL_JOB] = "b"
    cache.apply("MODIFIED", moved)
    assert notes.take() == {(NS, "a"), (NS, "b")}
    assert tuple(cache.get((NS, "a"))) == ()
    assert [p.uid for p in cache.get((NS, "b"))] == [f"{NS}-a-1-0"]


def test_pods_without_attempt_and_rank_labels_are_not_kept() -> None:
    notes = _Notes()
    cache = podcache.PodCache(notes)
    stray = _pod("a", 1, 0)
    del stray["metadata"]["labels"][names.LABEL_RANK]
    cache.apply("ADDED", stray)
    cache.replace(None, [stray])
    assert len(cache) == 0 and notes.take() == set()


@pytest.mark.parametrize("flag", ["team-*", "a,b", "Team"])
def test_namespace_patterns_are_refused_at_start(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The operator's pod watch needs namespace names (kopf alone would take globs)."""
    with pytest.raises(SystemExit) as exited:
        operator_main.main(["--namespace", "ok", "--namespace", flag])
    assert exited.value.code == 2
    assert f"not patterns: {flag}" in capsys.readouterr().err
