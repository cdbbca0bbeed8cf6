"""Pure parts of the Ray driver: bundle layout (and the node order of a new
placement after a node loss), rank env, GPU env, the recovery decision table
(a lost node restarts in place on a new placement while the budget lasts), the
command line, the status.ray patch, the monitor's group fencing (the
`CheckpointMonitor` class without Ray), and when standby rank actors start
and with which process env."""

from __future__ import annotations

import datetime
import typing

import pytest

from cairn.api import exitcodes
from cairn.checkpoint import monitor
from cairn.trainer.raydriver import cli, placement, recovery, standby
from cairn.trainer.raydriver import status as status_mod

# -- placement -------------------------------------------------------------------------


def test_layout_two_nodes_two_procs_pins_ranks_by_node() -> None:
    got = placement.layout(["head", "w1", "w2"], nodes=2, procs_per_node=2, cpus=1, gpus=0)
    assert got.bundles == [{"CPU": 1}] * 4
    assert got.node_of_rank == [0, 0, 1, 1]
    assert [s[placement.NODE_ID_LABEL] for s in got.selectors] == ["head", "head", "w1", "w1"]


def test_a_replacement_node_takes_the_lost_nodes_place_and_survivors_keep_theirs() -> None:
    # w1 (node rank 1) lost; its replacement w9 takes rank 1, w2 keeps rank 2.
    got = placement.keep_positions(["head", "w1", "w2"], ["w2", "head", "w9"])
    assert got == ["head", "w9", "w2"]


def test_two_lost_nodes_take_new_ones_by_id_and_extras_follow() -> None:
    got = placement.keep_positions(["head", "w1", "w2"], ["head", "wb", "wa", "wc"])
    assert got == ["head", "wa", "wb", "wc"]


def test_a_lost_node_without_a_replacement_yet_cannot_be_placed() -> None:
    with pytest.raises(ValueError, match="3 nodes wanted, 2 alive"):
        placement.keep_positions(["head", "w1", "w2"], ["head", "w2"])


def test_layout_gpu_bundle_carries_gpu() -> None:
    got = placement.layout(["head"], nodes=1, procs_per_node=2, cpus=2, gpus=1)
    assert got.bundles == [{"CPU": 2, "GPU": 1}] * 2


def test_layout_too_few_nodes_names_the_counts() -> None:
    with pytest.raises(ValueError, match="2 nodes wanted, 1 alive"):
        placement.layout(["head"], nodes=2, procs_per_node=1, cpus=1, gpus=0)


def test_world_size_rejects_zero() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        placement.world_size(nodes=0, procs_per_node=2)


def test_order_nodes_head_first_rest_sorted() -> None:
    assert placement.order_nodes(["c", "head", "a"], head="head") == ["head", "a", "c"]


def test_order_nodes_head_missing_raises() -> None:
    with pytest.raises(ValueError, match="not among the alive nodes"):
        placement.order_nodes(["a"], head="head")


def test_rank_env_is_torchrun_shaped() -> None:
    env = placement.rank_env(3, node_of_rank=[0, 0, 1, 1], procs_per_node=2)
    assert env["RANK"] == "3"
    assert env["WORLD_SIZE"] == "4"
    assert env["LOCAL_RANK"] == "1"
    assert env["LOCAL_WORLD_SIZE"] == "2"
    assert env["CAIRN_NODE_RANK"] == "1"


def test_cuda_env_shows_the_nodes_gpus_and_indexes_local_rank() -> None:
    got = placement.cuda_env([["3"], ["1"], ["0"]], node_of_rank=[0, 0, 1])
    assert got[0] == {"CUDA_VISIBLE_DEVICES": "1,3", "LOCAL_RANK": "1"}
    assert got[1] == {"CUDA_VISIBLE_DEVICES": "1,3", "LOCAL_RANK": "0"}
    assert got[2] == {"CUDA_VISIBLE_DEVICES": "0", "LOCAL_RANK": "0"}


def test_cuda_env_cpu_ranks_get_nothing() -> None:
    assert placement.cuda_env([[], []], node_of_rank=[0, 0]) == [{}, {}]


# -- recovery decision -----------------------------------------------------------------


def _died() -> recovery.GroupEnd:
    return recovery.GroupEnd(kind="rank_died", rank=1, reason="SIGKILL")


def test_rank_died_with_budget_restarts_in_place() -> None:
    got = recovery.decide(_died(), restarts_done=0, budget=3, preempting=False)
    assert got.restart and "in-place restart 1/3" in got.reason


def test_rank_died_budget_spent_exits_retryable() -> None:
    got = recovery.decide(_died(), restarts_done=3, budget=3, preempting=False)
    assert not got.restart and got.exit_code == recovery.RETRYABLE_EXIT_CODE
    assert "budget (3) is spent" in got.reason


def test_zero_budget_never_restarts() -> None:
    got = recovery.decide(_died(), restarts_done=0, budget=0, preempting=False)
    assert not got.restart and got.exit_code == recovery.RETRYABLE_EXIT_CODE


def test_rank_died_while_preempting_exits_retryable() -> None:
    got = recovery.decide(_died(), restarts_done=0, budget=3, preempting=True)
    assert not got.restart and got.exit_code == recovery.RETRYABLE_EXIT_CODE


def _node_lost() -> recovery.GroupEnd:
    return recovery.GroupEnd(kind="node_lost", rank=1, reason="node(s) ['x'] not alive")


def test_node_lost_with_budget_restarts_in_place_on_a_new_placement() -> None:
    got = recovery.decide(_node_lost(), restarts_done=1, budget=3, preempting=False)
    assert got.restart and got.replace_nodes and got.exit_code == 0
    assert "in-place restart 2/3 once its replacement joins" in got.reason


def test_node_lost_with_the_budget_spent_exits_retryable() -> None:
    got = recovery.decide(_node_lost(), restarts_done=3, budget=3, preempting=False)
    assert not got.restart and not got.replace_nodes
    assert got.exit_code == recovery.RETRYABLE_EXIT_CODE
    assert "budget (3) is spent: pod-level restart" in got.reason


def test_node_lost_while_the_job_stops_exits_retryable() -> None:
    got = recovery.decide(_node_lost(), restarts_done=0, budget=3, preempting=True)
    assert not got.restart and got.exit_code == recovery.RETRYABLE_EXIT_CODE
    assert "the job is stopping" in got.reason


def test_a_rank_death_never_asks_for_new_nodes() -> None:
    assert not recovery.decide(_died(), restarts_done=0, budget=3, preempting=False).replace_nodes


@pytest.mark.parametrize("target", ["step:10", "none", "s3://bucket/other-job/step-000000020"])
def test_an_explicit_resume_target_is_spent_once_the_attempt_committed(target: str) -> None:
    env = {"CAIRN_RESUME_FROM": target, "CAIRN_RESUME_SHA256": "a" * 64, "CAIRN_ATTEMPT": "2"}
    # The first group, or a later one before any commit: the target again.
    assert recovery.group_resume_env(env, committed=None) == env
    # A group after a commit resumes the newest step (not a second rollback).
    later = recovery.group_resume_env(env, committed=15)
    assert later == {"CAIRN_RESUME_FROM": "latest", "CAIRN_ATTEMPT": "2"}
    assert env["CAIRN_RESUME_FROM"] == target  # the driver's own env untouched


def test_latest_or_no_target_is_left_as_it_is() -> None:
    assert recovery.group_resume_env({"CAIRN_RESUME_FROM": "latest"}, committed=5) == {
        "CAIRN_RESUME_FROM": "latest"
    }
    assert recovery.group_resume_env({"PATH": "/bin"}, committed=5) == {"PATH": "/bin"}


def test_rank_raised_exits_one() -> None:
    end = recovery.GroupEnd(kind="failed", rank=0, reason="rank 0 raised RayTaskError")
    assert recovery.decide(end, restarts_done=0, budget=3, preempting=False).exit_code == 1


def test_grace_timed_out_exits_retryable() -> None:
    end = recovery.GroupEnd(kind="timed_out", reason="no final checkpoint within 30s")
    got = recovery.decide(end, restarts_done=0, budget=3, preempting=True)
    assert got.exit_code == recovery.RETRYABLE_EXIT_CODE


@pytest.mark.parametrize(
    ("codes", "expected"),
    [
        ((0, 0), 0),
        ((exitcodes.PREEMPTED, exitcodes.PREEMPTED), exitcodes.PREEMPTED),
        ((0, exitcodes.CONFIG_ERROR), exitcodes.CONFIG_ERROR),
        ((exitcodes.PREEMPTED, 3), 3),
        ((2, None), 2),
    ],
)
def test_finished_codes_combine(codes: tuple[int | None, ...], expected: int) -> None:
    end = recovery.GroupEnd(kind="finished", codes=codes)
    assert recovery.decide(end, restarts_done=0, budget=3, preempting=False).exit_code == expected


# -- command line ------------------------------------------------------------------------


def test_cli_defaults_from_pod_env() -> None:
    cfg = cli.parse(
        ["cairn.trainer.reference:main", "--", "--steps=3"],
        {
            "CAIRN_NNODES": "2",
            "CAIRN_NPROC_PER_NODE": "2",
            "CAIRN_RAY_MAX_INPLACE_RESTARTS": "5",
            "CAIRN_RAY_NUM_GPUS": "1",
            "CAIRN_FINAL_CHECKPOINT_GRACE_SECONDS": "60",
        },
    )
    assert (cfg.nodes, cfg.procs_per_node, cfg.max_inplace_restarts) == (2, 2, 5)
    assert cfg.gpus_per_rank == 1.0
    assert cfg.grace_seconds == 60.0
    assert cfg.argv == ["--steps=3"]


def test_cli_flags_override_env() -> None:
    cfg = cli.parse(
        ["--nodes=1", "--procs-per-node=3", "--max-inplace-restarts=0", "m:f"],
        {"CAIRN_NNODES": "2"},
    )
    assert (cfg.nodes, cfg.procs_per_node, cfg.max_inplace_restarts, cfg.argv) == (1, 3, 0, [])


def test_cli_standbys_are_on_unless_turned_off() -> None:
    assert cli.parse(["m:f"], {}).standby is True
    assert cli.parse(["--no-standby", "m:f"], {}).standby is False


def test_cli_target_without_function_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="MODULE:FUNCTION"):
        cli.parse(["cairn.trainer.reference"], {})


def test_cli_malformed_env_names_the_variable() -> None:
    with pytest.raises(ValueError, match="CAIRN_NNODES"):
        cli.parse(["m:f"], {"CAIRN_NNODES": "two"})


# -- status.ray ---------------------------------------------------------------------------


def test_restart_body_counts_up_and_names_the_step() -> None:
    before = status_mod.current({"status": {"ray": {"group": 1, "inPlaceRestarts": 4}}})
    body = status_mod.restart_body(
        before,
        group=2,
        reason="rank 1 actor died",
        from_step=8,
        now=datetime.datetime(2026, 11, 23, 14, 0, tzinfo=datetime.UTC),
    )
    assert body == {
        "status": {
            "ray": {
                "group": 2,
                "inPlaceRestarts": 5,
                "lastInPlaceRestart": {
                    "time": "2026-11-23T14:00:00Z",
                    "reason": "rank 1 actor died",
                    "fromStep": 8,
                },
            }
        }
    }


def test_current_of_a_job_without_ray_status_is_zero() -> None:
    assert status_mod.current({"status": {}}) == status_mod.RayStatus()
    assert status_mod.current(None) == status_mod.RayStatus()


# -- the monitor's fencing (plain class) ---------------------------------------------------


def test_monitor_refuses_an_old_group_after_advance() -> None:
    mon = monitor.CheckpointMonitor(group=0)
    assert mon.put(0, "k/0", {"files": []}) == {}
    mon.advance(1)
    assert "fenced" in mon.put(0, "k/0", {"files": []})
    assert "fenced" in mon.propose(0, "step-2/committed", {"manifest": {}})
    assert "fenced" in mon.check(0)
    assert mon.check(1) == {}


def test_monitor_new_group_never_sees_old_reports() -> None:
    mon = monitor.CheckpointMonitor(group=0)
    mon.put(0, "ns/step-2/written/0", {"files": ["old"]})
    mon.advance(1)
    assert mon.get(1, "ns/step-2/written/0") == {"missing": True}


def test_monitor_refuses_going_back() -> None:
    mon = monitor.CheckpointMonitor(group=2)
    with pytest.raises(ValueError, match="older"):
        mon.advance(1)


def test_monitor_gather_waits_for_every_key() -> None:
    mon = monitor.CheckpointMonitor()
    mon.put(0, "w/0", {"a": 1})
    assert mon.get_all(0, ["w/0", "w/1"]) == {"missing": True}
    mon.put(0, "w/1", {"a": 2})
    assert mon.get_all(0, ["w/0", "w/1"]) == {"values": [{"a": 1}, {"a": 2}]}


def test_monitor_propose_first_wins_and_remembers_the_commit() -> None:
    mon = monitor.CheckpointMonitor()
    first = {"manifest": {"step": 4}}
    assert mon.propose(0, "cairn-ckpt/attempt-1/manager-0/step-4/committed", first) == {
        "value": first
    }
    assert mon.propose(0, "cairn-ckpt/attempt-1/manager-0/step-4/committed", {"error": "x"}) == {
        "value": first
    }
    mon.propose(0, "cairn-ckpt/attempt-1/manager-0/step-6/committed", {"error": "late"})
    assert mon.last_committed() == 4


def test_monitor_counts_a_node_local_commit_only_once_rank_0_committed_its_copy() -> None:
    # Node-local: rank 0 proposes the manifest (with its .metadata) so the
    # others commit their copies, then commits its own and proposes again.
    mon = monitor.CheckpointMonitor()
    key = "cairn-ckpt/attempt-1/manager-0/step-{}/committed"
    doc = {"manifest": {"step": 10}, "metadata": "bWV0YQ=="}
    mon.propose(0, key.format(10), doc)
    assert mon.last_committed() is None  # the others may commit; rank 0 has not
    mon.propose(0, key.format(10), dict(doc))  # through Ray: a copy
    assert mon.last_committed() == 10
    # A group killed between the two proposals of step 15: still 10.
    mon.propose(0, key.format(15), {"manifest": {"step": 15}, "metadata": "bWV0YQ=="})
    assert mon.last_committed() == 10
    # An error proposed after the first manifest never counts.
    mon.propose(0, key.format(15), {"error": "killed"})
    assert mon.last_committed() == 10


def test_monitor_preemption_is_sticky() -> None:
    mon = monitor.CheckpointMonitor()
    assert mon.preemption() is None
    mon.request_preemption()
    first = mon.preemption()
    mon.request_preemption()
    assert first is not None and mon.preemption() == first


# -- the rank actor's plain parts ------------------------------------------------------------


def test_exit_code_of_return_values() -> None:
    from cairn.trainer.raydriver import rank

    assert rank.exit_code(None) == 0
    assert rank.exit_code(143) == 143
    assert rank.exit_code(True) == 0
    assert rank.exit_code(False) == 1


def test_load_target_rejects_a_module_without_function() -> None:
    from cairn.trainer.raydriver import rank

    with pytest.raises(ValueError, match="MODULE:FUNCTION"):
        rank.load_target("cairn.trainer.reference")
    with pytest.raises(ValueError, match="is not a function"):
        rank.load_target("cairn.trainer.reference:PREEMPTED_EXIT_CODE")
    assert callable(rank.load_target("cairn.trainer.reference:main"))


# -- standby rank actors -----------------------------------------------------------------

_READY: dict[str, typing.Any] = {
    "enabled": True,
    "gpus_per_rank": 0.0,
    "restarts_done": 0,
    "budget": 3,
    "running_seconds": standby.STANDBY_AFTER_SECONDS,
    "have": False,
    "new_node": False,
}


def test_standbys_start_once_a_cpu_group_has_run_a_while_with_restarts_left() -> None:
    assert standby.wanted(**_READY)


def test_the_first_group_on_a_replacement_node_gets_longer_before_standbys() -> None:
    replaced = {**_READY, "new_node": True}
    assert standby.STANDBY_AFTER_NEW_NODE_SECONDS > standby.STANDBY_AFTER_SECONDS
    assert not standby.wanted(
        **{**replaced, "running_seconds": standby.STANDBY_AFTER_NEW_NODE_SECONDS - 0.1}
    )
    assert standby.wanted(**{**replaced, "running_seconds": standby.STANDBY_AFTER_NEW_NODE_SECONDS})


@pytest.mark.parametrize(
    "change",
    [
        {"enabled": False},
        {"gpus_per_rank": 1.0},
        {"gpus_per_rank": 0.5},
        {"restarts_done": 3},
        {"budget": 0},
        {"running_seconds": standby.STANDBY_AFTER_SECONDS - 0.1},
        {"have": True},
    ],
    ids=["off", "gpu", "half-gpu", "budget-spent", "no-budget", "too-early", "already"],
)
def test_no_standbys(change: dict[str, object]) -> None:
    assert not standby.wanted(**{**_READY, **change})


@pytest.mark.parametrize(
    ("cpus", "forwarded", "omp"),
    [(1.0, {}, "1"), (2.5, {}, "2"), (0.5, {}, "1"), (4.0, {"OMP_NUM_THREADS": "3"}, "3")],
)
def test_standby_env_is_a_ranks_at_import(cpus: float, forwarded: dict[str, str], omp: str) -> None:
    secrets = {"AWS_SECRET_ACCESS_KEY": "s3cr3t", "CAIRN_MANIFEST_KEYRING": "k", "TMPDIR": "/t"}
    env = standby.process_env({**forwarded, **secrets, "TORCH_LOGS": "dynamo"}, cpus_per_rank=cpus)
    # Only what torch reads at import: a runtime_env is kept in Ray's actor table.
    assert env == {"OMP_NUM_THREADS": omp, "TORCH_LOGS": "dynamo"}
