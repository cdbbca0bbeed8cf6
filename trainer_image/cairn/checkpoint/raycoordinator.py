"""`RayCoordinator`: the `Coordinator` protocol over the `CheckpointMonitor` actor.

Used by the `CheckpointManager` in a rank actor started by the Ray driver
(`cairn.trainer.raydriver`): `coordinator.from_default_group` returns one
when `CAIRN_RAY_MONITOR` is set. Every call carries this rank's group
generation; a reply `{"fenced": ...}` (the group was replaced by an in-place
restart) raises `FencedError`, so a zombie rank of an old group fails its
save instead of committing. Waits poll the actor with short sleeps, each
bounded by the caller's timeout; every Ray call is bounded too.

Imported only under Ray (this module imports `ray`).
"""

from __future__ import annotations

import dataclasses
import os
import time
import typing

import ray

from cairn.checkpoint import errors, monitor

CALL_TIMEOUT_SECONDS = 60.0
"""Bound on one call to the monitor actor (it answers in microseconds when alive)."""
POLL_SECONDS = 0.02


class RayCoordinator:
    """Coordinator of one rank of one group, backed by the monitor actor."""

    def __init__(
        self, handle: typing.Any, *, rank: int, world_size: int, group: int, namespace: str
    ) -> None:
        self._actor = handle
        self._rank = rank
        self._world_size = world_size
        self._group = group
        self._ns = namespace.rstrip("/")

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def group(self) -> int:
        return self._group

    def _key(self, key: str) -> str:
        return f"{self._ns}/{key}"

    def _call(self, method: str, *args: typing.Any) -> dict[str, typing.Any]:
        try:
            reply: dict[str, typing.Any] = ray.get(
                getattr(self._actor, method).remote(self._group, *args),
                timeout=CALL_TIMEOUT_SECONDS,
            )
        except ray.exceptions.GetTimeoutError as exc:
            raise errors.CoordinationTimeoutError(
                f"rank {self._rank}: the checkpoint monitor did not answer {method} "
                f"within {CALL_TIMEOUT_SECONDS:.0f}s"
            ) from exc
        except ray.exceptions.RayActorError as exc:
            raise errors.CheckpointError(
                f"rank {self._rank}: the checkpoint monitor is gone ({exc})"
            ) from exc
        if reply.get("fenced"):
            raise errors.FencedError(f"rank {self._rank}: {reply['fenced']}")
        return reply

    def _wait(
        self, method: str, args: tuple[typing.Any, ...], timeout: float, what: str
    ) -> dict[str, typing.Any]:
        deadline = time.monotonic() + timeout
        while True:
            reply = self._call(method, *args)
            if not reply.get("missing"):
                return reply
            if time.monotonic() >= deadline:
                raise errors.CoordinationTimeoutError(
                    f"rank {self._rank}: no report for {what} within {timeout:.0f}s "
                    "(a rank died or stalled)"
                )
            time.sleep(POLL_SECONDS)

    def publish(self, key: str, value: dict[str, typing.Any]) -> None:
        self._call("put", self._key(f"{key}/{self._rank}"), value)

    def gather(self, key: str, *, timeout: float) -> list[dict[str, typing.Any]]:
        keys = [self._key(f"{key}/{r}") for r in range(self._world_size)]
        reply = self._wait("get_all", (keys,), timeout, key)
        values: list[dict[str, typing.Any]] = reply["values"]
        return values

    def broadcast(self, key: str, value: dict[str, typing.Any]) -> None:
        self._call("put", self._key(key), value)

    def wait_for(self, key: str, *, timeout: float) -> dict[str, typing.Any]:
        reply = self._wait("get", (self._key(key),), timeout, key)
        value: dict[str, typing.Any] = reply["value"]
        return value

    def poll(self, key: str) -> dict[str, typing.Any] | None:
        reply = self._call("get", self._key(key))
        if reply.get("missing"):
            return None
        value: dict[str, typing.Any] = reply["value"]
        return value

    def propose(self, key: str, value: dict[str, typing.Any]) -> dict[str, typing.Any]:
        reply = self._call("propose", self._key(key), value)
        won: dict[str, typing.Any] = reply["value"]
        return won

    def commit_fence(self) -> GroupFence:
        """The fence rank 0 checks right before each commit (local and remote)."""
        return GroupFence(coordinator=self)

    def check_current(self) -> None:
        """Raise FencedError when this rank's group is no longer the monitor's current one."""
        self._call("check")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GroupFence:
    """`fence.Fence` asking the monitor whether our group is still current."""

    coordinator: RayCoordinator

    def check(self, attempt: int) -> None:
        self.coordinator.check_current()


def from_env(*, namespace: str, env: typing.Mapping[str, str] | None = None) -> RayCoordinator:
    """The coordinator of this rank actor, from what the driver set in its env."""
    source = os.environ if env is None else env
    name = source[monitor.MONITOR_ENV]
    handle = ray.get_actor(name, namespace=source.get(monitor.NAMESPACE_ENV) or None)
    return RayCoordinator(
        handle,
        rank=int(source["RANK"]),
        world_size=int(source["WORLD_SIZE"]),
        group=int(source.get(monitor.GROUP_ENV) or 0),
        namespace=namespace,
    )
