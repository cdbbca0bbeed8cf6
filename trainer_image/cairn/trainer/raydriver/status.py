"""`status.ray` in the API: the driver's record of rank-actor generations.

The driver (head pod, rank 0's service account) merge-patches
`status.ray = {group, inPlaceRestarts, lastInPlaceRestart}` BEFORE it starts
a new group in place, so the API fence (`cairn.checkpoint.fence.ApiFence`)
refuses the old group's commits from then on. Without API access (library
use, tests) the monitor's fence alone protects the commit.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import typing

log = logging.getLogger(__name__)

PatchFn = typing.Callable[[dict[str, typing.Any]], None]
ReadFn = typing.Callable[[], dict[str, typing.Any] | None]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RayStatus:
    group: int = 0
    in_place_restarts: int = 0


def current(job: dict[str, typing.Any] | None) -> RayStatus:
    """status.ray of a TrainingJob object (zeros when absent). Pure."""
    ray_status = ((job or {}).get("status") or {}).get("ray") or {}
    group = ray_status.get("group")
    restarts = ray_status.get("inPlaceRestarts")
    return RayStatus(
        group=group if isinstance(group, int) else 0,
        in_place_restarts=restarts if isinstance(restarts, int) else 0,
    )


def restart_body(
    before: RayStatus, *, group: int, reason: str, from_step: int | None, now: datetime.datetime
) -> dict[str, typing.Any]:
    """The merge patch announcing group `group` (an in-place restart). Pure."""
    return {
        "status": {
            "ray": {
                "group": group,
                "inPlaceRestarts": before.in_place_restarts + 1,
                "lastInPlaceRestart": {
                    "time": now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "reason": reason[:1024],
                    "fromStep": from_step,
                },
            }
        }
    }


@dataclasses.dataclass(kw_only=True)
class Reporter:
    """Writes status.ray when the pod contract asks for status reports."""

    patch: PatchFn
    read: ReadFn

    def group_started(self, *, group: int, reason: str, from_step: int | None) -> bool:
        """Record the in-place restart into `group`; False (logged) when the API refused."""
        try:
            before = current(self.read())
            self.patch(
                restart_body(
                    before,
                    group=group,
                    reason=reason,
                    from_step=from_step,
                    now=datetime.datetime.now(datetime.UTC),
                )
            )
        except Exception as exc:  # the API is a second fence; the monitor still fences
            log.warning("could not record in-place restart (group %d) in status: %s", group, exc)
            return False
        return True

    def initial_group(self) -> int:
        """The group to start with: status.ray.group of this attempt (0 when absent)."""
        try:
            return current(self.read()).group
        except Exception as exc:
            log.warning("could not read status.ray (starting at group 0): %s", exc)
            return 0


def from_env(env: typing.Mapping[str, str]) -> Reporter | None:
    """The reporter of a head pod with CAIRN_REPORT_STATUS=1; None otherwise."""
    from cairn.api import podenv

    name, namespace = env.get(podenv.JOB_NAME), env.get(podenv.NAMESPACE)
    if env.get(podenv.REPORT_STATUS) != "1" or not name or not namespace:
        return None
    from kubernetes import client, config

    from cairn.checkpoint import status_reporter

    try:
        config.load_incluster_config()
    except config.ConfigException as exc:
        log.warning("no in-cluster API access (status.ray not reported): %s", exc)
        return None
    api_client = client.ApiClient()
    return Reporter(
        patch=status_reporter.kubernetes_patcher(
            api_client=api_client, namespace=namespace, name=name
        ),
        read=status_reporter.job_reader(api_client=api_client, namespace=namespace, name=name),
    )
