"""A reconcile that gets no answer from the API server backs off, per job, with jitter.

The fault is real, not mocked: the Kubernetes client talks to a loopback
port nobody listens on (connection refused, raised by urllib3 as it would be
for an API server that is down). The 429/Retry-After half runs against the
real API server in tests/integration/operator/test_reconcile_backoff.py.

Covers: a transport error is caught and counted (the daemon is not crashed
into kopf's lockstep restart) and ``reconcile_guarded`` answers None; the
n-th failure in a row waits within ``[d * (1 - jitter), d]`` of the doubled
delay and never past the cap; jobs failing at the same moment draw different
delays; ``forget`` drops a deleted job's failure count and delay; a job that
never failed waits the base delay; the job's daemon, backing off, is not woken
by kicks (a throttled operator does not hammer the server) but stops when told.
"""

import asyncio
import socket
import typing

from kubernetes import client

from cairn.operator import handlers, kubeapi, reconcile, runtime
from cairn.operator.core import tunables

from . import jobs

SETTINGS = tunables.Settings(
    reconcile=tunables.Reconcile(
        error_retry_seconds=1.0, error_backoff_cap_seconds=4.0, error_jitter=0.5
    )
)


def _unreachable() -> kubeapi.KubeApi:
    """A client of a loopback port that was just closed: every call is refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    configuration = client.Configuration()
    configuration.host = f"http://127.0.0.1:{port}"
    configuration.retries = 0  # urllib3's own retries would only repeat the refusal
    return kubeapi.KubeApi.of(client.ApiClient(configuration))


async def _fail(state: runtime.Runtime, name: str) -> tuple[float | None, float]:
    body = jobs.body()
    body["metadata"]["name"] = name
    answer = await state.reconcile_guarded(
        ("ml", name),
        body=body,
        written=reconcile.Written(),
        truth=reconcile.PodTruth(list_first=True),  # the first call lists pods: refused
    )
    return answer, state.retry_wait(("ml", name))


def test_transport_error_is_caught_and_counted() -> None:
    async def main() -> None:
        state = runtime.Runtime(api=_unreachable(), settings=SETTINGS)
        try:
            answer, wait = await _fail(state, "demo")
            assert answer is None
            assert state.failures[("ml", "demo")] == 1
            assert 0.5 <= wait <= 1.0
        finally:
            state.close()

    asyncio.run(main())


def test_failures_in_a_row_double_within_jitter_up_to_the_cap() -> None:
    async def main() -> None:
        state = runtime.Runtime(api=_unreachable(), settings=SETTINGS)
        try:
            for failures, full in enumerate([1.0, 2.0, 4.0, 4.0, 4.0], start=1):
                _, wait = await _fail(state, "demo")
                assert state.failures[("ml", "demo")] == failures
                assert full * 0.5 <= wait <= full, (failures, wait)
        finally:
            state.close()

    asyncio.run(main())


def test_jobs_failing_together_draw_their_own_delays() -> None:
    async def main() -> None:
        state = runtime.Runtime(api=_unreachable(), settings=SETTINGS)
        try:
            waits = [(await _fail(state, f"job-{n}"))[1] for n in range(8)]
            assert len(set(waits)) > 1, waits  # no lockstep return
            assert all(0.5 <= wait <= 1.0 for wait in waits)
        finally:
            state.close()

    asyncio.run(main())


def test_forget_drops_the_backoff_and_a_fresh_job_waits_the_base() -> None:
    async def main() -> None:
        state = runtime.Runtime(api=_unreachable(), settings=SETTINGS)
        try:
            await _fail(state, "demo")
            state.forget(("ml", "demo"))
            assert ("ml", "demo") not in state.failures
            assert state.retry_wait(("ml", "demo")) == SETTINGS.reconcile.error_retry_seconds
        finally:
            state.close()

    asyncio.run(main())


class _Stopped:
    """kopf's DaemonStopped, as far as the loop reads it."""

    def __init__(self) -> None:
        self.flag = asyncio.Event()

    def __bool__(self) -> bool:
        return self.flag.is_set()

    async def wait(self) -> object:
        return await self.flag.wait()


def test_a_backing_off_daemon_ignores_kicks_and_stops_when_told() -> None:
    slow = tunables.Settings(
        reconcile=tunables.Reconcile(
            error_retry_seconds=30.0, error_backoff_cap_seconds=30.0, error_jitter=0.0
        )
    )

    async def main() -> None:
        state = runtime.Runtime(api=_unreachable(), settings=slow)
        state.pods_listed.set()
        stopped = _Stopped()
        key = ("ml", "demo")
        loop: typing.Any = handlers.reconcile_loop  # kopf types it for kopf's own call
        daemon: asyncio.Task[None] = asyncio.create_task(
            loop(
                namespace="ml",
                name="demo",
                body=jobs.body(),
                stopped=stopped,
                memo={"runtime": state},
            )
        )
        try:
            async with asyncio.timeout(30):
                while state.failures.get(key) != 1:
                    await asyncio.sleep(0.01)
            for _ in range(3):
                state.kick("ml", "demo")
                await asyncio.sleep(0.05)
            assert state.failures[key] == 1, "a kick cut the 30 s backoff short"
            stopped.flag.set()
            async with asyncio.timeout(10):
                await daemon
        finally:
            daemon.cancel()
            state.close()

    asyncio.run(main())
