"""runtime.Runtime: one operator's state, so two operators can live in one process.

Covers: two runtimes share no pod cache, kicks, locks, finished-job queue,
S3 scheduler or S3 threads; a kick wakes the job's daemon in its own runtime
only; a kick of a job without a daemon queues it as finished only where the
job is known as finished; ``forget`` drops a deleted job everywhere.
"""

import asyncio
import typing

from cairn.operator import kubeapi, runtime

from . import jobs


def _two() -> tuple[runtime.Runtime, runtime.Runtime]:
    # No call reaches the API server in these tests: the api is never used.
    a = typing.cast(kubeapi.KubeApi, object())
    b = typing.cast(kubeapi.KubeApi, object())
    return runtime.Runtime(api=a), runtime.Runtime(api=b)


def test_two_runtimes_share_no_state() -> None:
    async def main() -> None:
        a, b = _two()
        try:
            assert a.pods is not b.pods
            assert a.finished is not b.finished
            assert a.s3_loop is not b.s3_loop
            assert a.storage_pool is not b.storage_pool
            assert a.pods_listed is not b.pods_listed
            assert a.lock(("ns", "job")) is a.lock(("ns", "job"))
            assert a.lock(("ns", "job")) is not b.lock(("ns", "job"))
        finally:
            a.close()
            b.close()

    asyncio.run(main())


def test_a_kick_wakes_the_daemon_of_its_own_runtime_only() -> None:
    async def main() -> None:
        a, b = _two()
        try:
            woken_a = a.kicks.setdefault(("ns", "job"), asyncio.Event())
            woken_b = b.kicks.setdefault(("ns", "job"), asyncio.Event())
            a.kick("ns", "job")
            assert woken_a.is_set()
            assert not woken_b.is_set()
        finally:
            a.close()
            b.close()

    asyncio.run(main())


def test_a_finished_job_is_queued_and_forgotten_per_runtime() -> None:
    async def main() -> None:
        a, b = _two()
        try:
            raw = jobs.body()
            raw["status"] = {"phase": "Succeeded"}
            a.finished.note(("ns", "job"), raw)
            a.foreign_reported[("ns", "job")] = frozenset({"stranger"})
            b.kick("ns", "job")  # b does not know the job: nothing queued
            assert ("ns", "job") in a.finished.bodies
            assert ("ns", "job") not in b.finished.bodies
            a.forget(("ns", "job"))
            assert ("ns", "job") not in a.finished.bodies
            assert ("ns", "job") not in a.foreign_reported
        finally:
            a.close()
            b.close()

    asyncio.run(main())
