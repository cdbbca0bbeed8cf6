"""Leader election with a ``coordination.k8s.io/v1`` Lease, so two replicas are safe.

kopf has no leader election (its "peering" only pauses peers of lower
priority; two of equal priority both freeze), so the election sits around
kopf, at process level, the way client-go's ``leaderelection`` does it:

1. ``campaign`` blocks until this process holds the Lease (a standby polls
   every ``retry_period``); only then does ``__main__`` start kopf, so a
   standby never runs a handler, a daemon or the S3 pass.
2. ``Elector.keep_leading`` renews the Lease every ``retry_period`` in a
   thread. If no renewal succeeded for ``renew_deadline`` (the API server is
   unreachable, or another process took the Lease) it calls ``on_lost``,
   which ends the process at once (``os._exit``): a leader that cannot prove
   it still leads stops acting before anyone else may take over, because
   ``renew_deadline < lease_duration``. The Deployment restarts it as a
   standby.
3. On a clean shutdown (SIGTERM: kopf returns) ``release`` empties
   ``holderIdentity``, so the standby takes over within ``retry_period``
   instead of waiting for the Lease to expire.

A standby judges expiry by its own clock: the Lease is free when its record
(holder, renewTime, resourceVersion) has not changed for ``lease_duration``
seconds of local monotonic time since this process last saw it change, so
clock skew between nodes does not matter (client-go does the same). Writes
use the Lease's resourceVersion: of two standbys racing for an expired Lease
one gets 409 and keeps waiting.

``decide`` is pure; ``LeaseStore`` is the thin effect (read, create,
replace). Takeover after the leader dies: at most ``lease_duration`` plus
``retry_period`` (15 s + 2 s by default), measured in
tests/integration/operator/test_leader_election.py and docs/operator.md.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

import urllib3
from kubernetes import client
from kubernetes.client import exceptions as k8s_exceptions

LOG = logging.getLogger(__name__)

Action = Literal["create", "acquire", "renew", "wait"]
_FAILURES = (k8s_exceptions.ApiException, urllib3.exceptions.HTTPError, OSError)
"""What a Lease call may raise that the election survives (retried next period)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    """Where the Lease lives and its timing (client-go's defaults)."""

    name: str = "cairn-operator"
    namespace: str = "default"
    identity: str = dataclasses.field(
        default_factory=lambda: f"{socket.gethostname()}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    )
    lease_duration: float = 15.0
    """A standby takes the Lease after its record stayed unchanged this long."""
    renew_deadline: float = 10.0
    """The leader gives up (exits) when it could not renew for this long."""
    retry_period: float = 2.0
    """How often the leader renews and a standby looks."""

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError(
                "leader election needs 0 < retry_period < renew_deadline < lease_duration, got "
                f"{self.retry_period}, {self.renew_deadline}, {self.lease_duration}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Record:
    """What the Lease says (the fields the election reads)."""

    holder: str
    renew_time: str
    resource_version: str
    transitions: int = 0

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.holder, self.renew_time, self.resource_version)


def decide(
    *, record: Record | None, identity: str, unchanged_for: float, lease_duration: float
) -> Action:
    """What to do with the Lease now. Pure.

    ``unchanged_for``: local seconds since this process saw the record change.
    """
    if record is None:
        return "create"
    if record.holder == identity:
        return "renew"
    if not record.holder or unchanged_for >= lease_duration:
        return "acquire"
    return "wait"


def _micro_time(now: datetime.datetime) -> str:
    return now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseStore:
    """The Lease object in the API server (blocking calls)."""

    def __init__(self, api: client.ApiClient, settings: Settings) -> None:
        self._api = client.CoordinationV1Api(api)
        self._settings = settings
        # Every call bounded: a request hanging on a dead connection (seen on the
        # devcluster after a pod's network went away) would otherwise stall a
        # standby forever, or a leader past its renew deadline.
        self._timeout = min(5.0, settings.renew_deadline / 2)

    def read(self) -> Record | None:
        try:
            lease = self._api.read_namespaced_lease(
                self._settings.name, self._settings.namespace, _request_timeout=self._timeout
            )
        except k8s_exceptions.ApiException as error:
            if error.status == 404:
                return None
            raise
        spec = lease.spec
        renew = spec.renew_time
        return Record(
            holder=spec.holder_identity or "",
            renew_time=_micro_time(renew) if isinstance(renew, datetime.datetime) else str(renew),
            resource_version=lease.metadata.resource_version or "",
            transitions=spec.lease_transitions or 0,
        )

    def _body(self, *, holder: str, transitions: int, acquired: bool) -> dict[str, Any]:
        now = _micro_time(datetime.datetime.now(datetime.UTC))
        spec: dict[str, Any] = {
            "holderIdentity": holder,
            "leaseDurationSeconds": int(self._settings.lease_duration),
            "renewTime": now,
            "leaseTransitions": transitions,
        }
        if acquired:
            spec["acquireTime"] = now
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self._settings.name, "namespace": self._settings.namespace},
            "spec": spec,
        }

    def create(self) -> bool:
        """Create the Lease held by us; False if someone else created it first."""
        body = self._body(holder=self._settings.identity, transitions=0, acquired=True)
        try:
            self._api.create_namespaced_lease(
                self._settings.namespace, body, _request_timeout=self._timeout
            )
        except k8s_exceptions.ApiException as error:
            if error.status == 409:
                return False
            raise
        return True

    def write(self, record: Record, *, holder: str, acquired: bool) -> bool:
        """Replace the Lease if it is still ``record``; False on a lost race (409)."""
        transitions = record.transitions + (1 if acquired else 0)
        body = self._body(holder=holder, transitions=transitions, acquired=acquired)
        body["metadata"]["resourceVersion"] = record.resource_version
        try:
            self._api.replace_namespaced_lease(
                self._settings.name, self._settings.namespace, body, _request_timeout=self._timeout
            )
        except k8s_exceptions.ApiException as error:
            if error.status == 409:
                return False
            raise
        return True


class Elector:
    """One process's side of the election."""

    def __init__(
        self,
        store: LeaseStore,
        settings: Settings,
        *,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._store = store
        self._monotonic = monotonic
        self._seen: tuple[str, str, str] | None = None
        self._seen_at = monotonic()
        self._stop = threading.Event()

    def _unchanged_for(self, record: Record | None) -> float:
        now = self._monotonic()
        key = record.key if record is not None else None
        if key != self._seen:
            self._seen, self._seen_at = key, now
        return now - self._seen_at

    def try_once(self) -> bool:
        """One look at the Lease; True while we hold it afterwards."""
        record = self._store.read()
        action = decide(
            record=record,
            identity=self.settings.identity,
            unchanged_for=self._unchanged_for(record),
            lease_duration=self.settings.lease_duration,
        )
        if action == "create":
            return self._store.create()
        if action == "wait" or record is None:
            return False
        acquired = action == "acquire"
        held = self._store.write(record, holder=self.settings.identity, acquired=acquired)
        if held and acquired:
            LOG.info(
                "leader election: acquired Lease %s/%s (previous holder %r)",
                self.settings.namespace,
                self.settings.name,
                record.holder,
            )
        return held

    def campaign(self, *, until: Callable[[], bool] = lambda: False) -> bool:
        """Block until we hold the Lease (True) or ``until()`` says stop (False)."""
        LOG.info("leader election: %s waits for Lease", self.settings.identity)
        while not until():
            try:
                if self.try_once():
                    return True
            except _FAILURES as error:
                LOG.warning("leader election: reading the Lease failed: %s", error)
            time.sleep(self.settings.retry_period)
        return False

    def keep_leading(self, on_lost: Callable[[], None]) -> threading.Thread:
        """Renew in a daemon thread; ``on_lost()`` when renewal failed for renew_deadline."""

        def renew_loop() -> None:
            last_ok = self._monotonic()
            while not self._stop.wait(self.settings.retry_period):
                try:
                    if self.try_once():
                        last_ok = self._monotonic()
                        continue
                    LOG.error("leader election: another process holds the Lease")
                    on_lost()
                    return
                except _FAILURES as error:
                    LOG.warning("leader election: renewal failed: %s", error)
                if self._monotonic() - last_ok >= self.settings.renew_deadline:
                    LOG.error(
                        "leader election: not renewed for %.0f s", self.settings.renew_deadline
                    )
                    on_lost()
                    return

        thread = threading.Thread(target=renew_loop, name="cairn-leader", daemon=True)
        thread.start()
        return thread

    def release(self) -> None:
        """Stop renewing and hand the Lease back (best effort), for a fast takeover."""
        self._stop.set()
        try:
            record = self._store.read()
            if record is not None and record.holder == self.settings.identity:
                self._store.write(record, holder="", acquired=False)
                LOG.info("leader election: released Lease %s", self.settings.name)
        except _FAILURES as error:
            LOG.warning("leader election: releasing the Lease failed: %s", error)


def exit_now() -> None:
    """What a leader does when it lost the Lease: stop acting at once."""
    logging.shutdown()
    os._exit(75)
