"""Leader election: two operator processes on one Lease, against the devcluster.

Two ``python -m cairn.operator --leader-elect`` processes (watching only a
temporary namespace, their Lease in it, default timing 15/10/2 s; separate
from the shared operator, which stays as it is) share one
``coordination.k8s.io`` Lease. Covers: exactly one holds it and runs kopf
(its liveness endpoint is kopf's) while the other stands by (its endpoint
answers ``standby``) and does not take over while the leader lives;
SIGKILL of the leader: the standby takes the Lease once it expired, then
starts kopf (takeover times printed); SIGTERM of the leader: it releases
the Lease and the standby takes it without waiting for expiry; a leader
whose Lease another holder took exits (code 75) instead of acting on.
"""

import contextlib
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.conftest import DevclusterHandle
from tests.integration.devcluster import kube_helpers as kh

pytestmark = pytest.mark.cluster
LEASE = "cairn-operator-test"
WAIT = 60.0
"""Bound of every wait: lease duration (15 s) plus starts, with a wide margin."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Replica:
    """One operator process, as a Deployment replica would run it."""

    def __init__(self, handle: DevclusterHandle, namespace: str, log: pathlib.Path) -> None:
        self.port = _free_port()
        env = dict(os.environ)
        env["KUBECONFIG"] = str(handle.kubeconfig)
        env["TMPDIR"] = str(handle.target.state.tmp)
        argv = [
            sys.executable,
            "-m",
            "cairn.operator",
            "--namespace",
            namespace,
            "--leader-elect",
            "--lease-name",
            LEASE,
            "--lease-namespace",
            namespace,
            f"--liveness=http://127.0.0.1:{self.port}/healthz",
            "--metrics-port=0",
        ]
        self.log = log
        with log.open("wb") as out:
            self.process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.process.pid

    def health(self) -> str | None:
        """What its liveness endpoint answers; None while it does not."""
        url = f"http://127.0.0.1:{self.port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                return str(answer.read().decode())
        except (urllib.error.URLError, OSError):
            return None

    def standing_by(self) -> bool:
        return self.health() == "standby\n"

    def running_kopf(self) -> bool:
        answer = self.health()
        return answer is not None and answer != "standby\n"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


class Election:
    def __init__(self, handle: DevclusterHandle, namespace: str, tmp: pathlib.Path) -> None:
        self.handle = handle
        self.namespace = namespace
        self.tmp = tmp
        self.leases = client.CoordinationV1Api(handle.api_client)
        self.replicas: list[Replica] = []

    def start(self, name: str) -> Replica:
        replica = Replica(self.handle, self.namespace, self.tmp / f"{name}.log")
        self.replicas.append(replica)
        return replica

    def holder(self) -> str:
        try:
            lease = self.leases.read_namespaced_lease(LEASE, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return ""
            raise
        return str(lease.spec.holder_identity or "")

    def held_by(self, replica: Replica) -> bool:
        return f"_{replica.pid}_" in self.holder()

    def wait_leader(self, replica: Replica) -> float:
        """Seconds until `replica` holds the Lease and runs kopf."""
        started = time.monotonic()
        kh.wait_for(lambda: self.held_by(replica), timeout=WAIT, what=f"pid {replica.pid} to lead")
        kh.wait_for(replica.running_kopf, timeout=WAIT, what=f"pid {replica.pid} to run kopf")
        return time.monotonic() - started


@pytest.fixture
def election(devcluster: DevclusterHandle, tmp_path: pathlib.Path) -> Iterator[Election]:
    with contextlib.contextmanager(kh.temp_namespace)(devcluster.core, prefix="lead") as namespace:
        found = Election(devcluster, namespace, tmp_path)
        try:
            yield found
        finally:
            for replica in found.replicas:
                replica.stop()


def _two(election: Election) -> tuple[Replica, Replica]:
    first = election.start("a")
    election.wait_leader(first)
    second = election.start("b")
    kh.wait_for(second.standing_by, timeout=WAIT, what="the second replica to stand by")
    assert election.held_by(first)
    assert first.running_kopf()
    return first, second


def test_standby_takes_over_after_the_leader_is_killed(election: Election) -> None:
    leader, standby = _two(election)
    leader.process.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    leader.process.wait(timeout=10)
    kh.wait_for(lambda: election.held_by(standby), timeout=WAIT, what="the standby to lead")
    lease_taken = time.monotonic() - killed
    kh.wait_for(standby.running_kopf, timeout=WAIT, what="the new leader to run kopf")
    kopf_running = time.monotonic() - killed
    print(f"\nSIGKILL takeover: Lease after {lease_taken:.1f} s, kopf after {kopf_running:.1f} s")
    assert standby.process.poll() is None
    assert "leader election: acquired Lease" in standby.log.read_text()


def test_sigterm_releases_the_lease(election: Election) -> None:
    leader, standby = _two(election)
    leader.process.send_signal(signal.SIGTERM)
    stopped = time.monotonic()
    assert leader.process.wait(timeout=WAIT) == 0
    kh.wait_for(lambda: election.held_by(standby), timeout=WAIT, what="the standby to lead")
    taken = time.monotonic() - stopped
    print(f"\nSIGTERM handover: Lease after {taken:.1f} s")
    assert "released Lease" in leader.log.read_text()


def test_leader_that_lost_its_lease_exits(election: Election) -> None:
    leader = election.start("a")
    election.wait_leader(leader)

    def take() -> bool:
        lease = election.leases.read_namespaced_lease(LEASE, election.namespace)
        lease.spec.holder_identity = "intruder"
        try:
            election.leases.replace_namespaced_lease(LEASE, election.namespace, lease)
        except ApiException as exc:
            if exc.status == 409:  # the leader renewed in between: read again
                return False
            raise
        return True

    kh.wait_for(take, timeout=WAIT, what="another holder to take the Lease")
    assert leader.process.wait(timeout=WAIT) == 75
    assert "another process holds the Lease" in leader.log.read_text()
    assert election.holder() == "intruder"
