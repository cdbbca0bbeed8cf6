"""podcache's reflector against the real API server (no operator process).

Covers: the first list fills the cache and says so once; a pod created,
patched and deleted afterwards comes through the watch, and the job is
notified for what its plan reads (phase, deletion) but not for an annotation;
a pod the cache held that the list does not have (a ghost left by a watch
gap) is dropped by the list; a watch from a resourceVersion older than the
server keeps ends in ``GoneError`` (410), which ``run`` answers by listing
again; a stopped reflector's thread ends.
"""

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from cairn.operator import podcache
from cairn.operator.core import names
from tests.conftest import DevclusterHandle
from tests.integration.devcluster import kube_helpers as kh

pytestmark = pytest.mark.cluster
WAIT = 30.0


@pytest.fixture
def namespace(devcluster: DevclusterHandle) -> Iterator[str]:
    yield from kh.temp_namespace(devcluster.core, "refl")


def _pod(name: str, job: str) -> client.V1Pod:
    """A rank pod nobody runs: a scheduling gate keeps it unbound."""
    labels = {names.LABEL_JOB: job, names.LABEL_ATTEMPT: "1", names.LABEL_RANK: "0"}
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, labels=labels),
        spec=client.V1PodSpec(
            scheduling_gates=[client.V1PodSchedulingGate(name="cairn.dev/never")],
            containers=[client.V1Container(name="trainer", image="none", command=["true"])],
        ),
    )


def _ghost(namespace: str, job: str) -> dict[str, Any]:
    labels = {names.LABEL_JOB: job, names.LABEL_ATTEMPT: "1", names.LABEL_RANK: "1"}
    meta = {"name": f"{job}-a1-n1", "namespace": namespace, "uid": "ghost", "labels": labels}
    return {"metadata": meta, "status": {"phase": "Running"}}


def test_list_then_watch_keeps_the_cache_true(devcluster: DevclusterHandle, namespace: str) -> None:
    core = devcluster.core
    core.create_namespaced_pod(namespace, _pod("r-a1-n0", "r"))
    notified: list[tuple[str, str]] = []
    cache = podcache.PodCache(notified.append)
    cache.apply("ADDED", _ghost(namespace, "r"))  # deleted while a watch was away
    ready = threading.Event()
    lists: list[int] = []

    def listed() -> None:
        lists.append(1)
        ready.set()

    stop = podcache.start(
        api=devcluster.api_client, cache=cache, namespaces=[namespace], on_ready=listed
    )
    try:
        assert ready.wait(WAIT), "the first list came in"
        assert [p.name for p in cache.get((namespace, "r"))] == ["r-a1-n0"], "ghost dropped"
        notified.clear()
        core.patch_namespaced_pod("r-a1-n0", namespace, {"metadata": {"annotations": {"x": "y"}}})
        core.create_namespaced_pod(namespace, _pod("s-a1-n0", "s"))
        kh.wait_for(
            lambda: tuple(cache.get((namespace, "s"))), timeout=WAIT, what="s's pod in the cache"
        )
        assert (namespace, "r") not in notified, "an annotation is nothing the plan reads"
        core.delete_namespaced_pod("r-a1-n0", namespace, grace_period_seconds=0)
        kh.wait_for(
            lambda: not tuple(cache.get((namespace, "r"))), timeout=WAIT, what="r's pod gone"
        )
        assert (namespace, "r") in notified
        assert lists == [1], "ready is said once"
    finally:
        stop.set()


def test_a_too_old_version_is_gone_and_run_lists_again(
    devcluster: DevclusterHandle, namespace: str
) -> None:
    cache = podcache.PodCache()
    stop = threading.Event()
    lists: list[int] = []
    reflector = podcache.Reflector(
        api=devcluster.api_client,
        cache=cache,
        namespace=namespace,
        on_listed=lambda: lists.append(1),
        stop=stop,
    )
    with pytest.raises(podcache.GoneError):
        reflector._watch("1")
    # run(): a list, then a watch; force a 410 by handing it a stale version.
    real_watch = reflector._watch
    versions: list[str] = []

    def stale_once(version: str) -> str:
        versions.append(version)
        if len(versions) == 1:
            return real_watch("1")
        stop.set()
        return version

    reflector._watch = stale_once  # type: ignore[method-assign]
    thread = threading.Thread(target=reflector.run, daemon=True)
    thread.start()
    thread.join(WAIT)
    assert not thread.is_alive(), "a stopped reflector's thread ends"
    assert len(lists) == 2, "410 Gone: listed again"
    assert len(versions) == 2 and versions[1] != "1"
