"""The zombie scenario of test_zombie_fencing, run as its own Ray client process.

    python zombie_scenario.py <ray address> <work dir>

Writes `<work dir>/result.json`. A separate process keeps Ray's client (its
threads, its global state) out of the pytest process.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time
import typing

import ray

from cairn.checkpoint import errors, monitor, raycoordinator
from cairn.trainer.raydriver import rank
from tests.integration.ray import harness

RANK_ENV = ("CAIRN_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TMPDIR", "TORCH")


def scenario(address: str, work: pathlib.Path) -> dict[str, typing.Any]:
    namespace = f"zombie-{os.getpid()}"
    ray.init(address=address, namespace=namespace, log_to_driver=False)
    mon: typing.Any = (
        ray.remote(monitor.CheckpointMonitor)
        .options(name=monitor.ACTOR_NAME, num_cpus=0)
        .remote(group=0)
    )
    zombie: typing.Any = ray.remote(rank.RankActor).options(num_cpus=1).remote(rank=0, group=0)
    where = ray.get(zombie.where.remote(), timeout=120)
    env = {
        **harness.base_env(work),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": where["ip"],
        "MASTER_PORT": str(where["port"]),
        monitor.MONITOR_ENV: monitor.ACTOR_NAME,
        monitor.NAMESPACE_ENV: namespace,
        monitor.GROUP_ENV: "0",
        "CAIRN_CKPT_FAULT": "write:0:2",
        "CAIRN_CKPT_FAULT_DIR": str(work),
        "CAIRN_CKPT_FAULT_SLEEP": "300",
    }
    # Only what the driver would set, not this process's whole environment.
    env = {k: v for k, v in env.items() if k.startswith(RANK_ENV)}
    run = zombie.run.remote(
        "cairn.trainer.reference:main", harness.trainer_args(work, steps=4), env, mon
    )
    marker = work / "write-0-2"
    deadline = time.monotonic() + 300
    while not marker.exists():
        ready, _ = ray.wait([run], timeout=0.1)
        if ready:
            return {"error": f"the zombie ended before the pause: {ray.get(run)}"}
        if time.monotonic() > deadline:
            return {"error": "the zombie never reached the write of step 2"}

    # The driver's recovery: the monitor moves to group 1 before a new group starts.
    ray.get(mon.advance.remote(1), timeout=60)
    fresh = raycoordinator.RayCoordinator(mon, rank=0, world_size=1, group=1, namespace="n")
    fresh.broadcast("init", {"ok": True})
    result: dict[str, typing.Any] = {"fresh_reads": fresh.wait_for("init", timeout=5)}
    old = raycoordinator.RayCoordinator(mon, rank=0, world_size=1, group=0, namespace="n")
    try:
        old.commit_fence().check(1)
        result["old_fence"] = "passed"
    except errors.FencedError as exc:
        result["old_fence"] = str(exc)

    (work / "write-0-2.release").write_text("")
    try:
        result["zombie"] = f"returned {ray.get(run, timeout=300)}"
    except ray.exceptions.RayTaskError as exc:
        result["zombie"] = str(exc)[-3000:]
    result["last_committed"] = ray.get(mon.last_committed.remote(), timeout=60)
    ray.kill(zombie)
    ray.kill(mon)
    return result


if __name__ == "__main__":
    work = pathlib.Path(sys.argv[2])
    outcome = scenario(sys.argv[1], work)
    (work / "result.json").write_text(json.dumps(outcome))
    ray.shutdown()
