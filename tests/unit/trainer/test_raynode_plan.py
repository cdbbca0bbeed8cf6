"""The Ray node launcher's pure decisions (``cairn.trainer.raynode_plan``).

Covers: the node's settings from the pod env the operator writes (head for
rank 0, workers otherwise, optional Ray settings), malformed contracts as
``LauncherError`` (exit 78), the ``ray start`` command lines of head and
worker, the children's env (RAY_ADDRESS, auth mode kept when the user set it,
never the loopback-only flag that forbids multi-node), token auth forced by the
job's token file (the user's RAY_AUTH_MODE/RAY_AUTH_TOKEN cannot undo it) and an
empty token file refused, the dashboard only when asked for (head only, on the
pod's IP), the version check, the
worker's exit decision (0 only after an announced success; the head's failure
echoed as ``FollowsHead``), parsing of the announced outcome, and a worker's
SIGTERM told apart: its own pod's loss (no driver flag within the window)
from the whole job stopping (the driver's preempting flag or an outcome).
"""

import pytest

from cairn.api import exitcodes, podenv
from cairn.trainer import raynode_plan

HEAD = "job-a1-n0.job.ns.svc.cluster.local"


def _env(rank: int = 0, **extra: str) -> dict[str, str]:
    return {
        podenv.NODE_RANK: str(rank),
        podenv.NNODES: "2",
        podenv.MASTER_ADDR_CAIRN: HEAD,
        podenv.RAY_PORT: "6379",
        podenv.POD_IP: "10.244.1.7",
        **extra,
    }


ARGV = ["--", "python", "-m", "cairn.trainer.raydriver", "m:f", "--", "--steps", "4"]


def test_rank_zero_is_the_head_with_the_driver_after_the_separator() -> None:
    cfg = raynode_plan.config(_env(0), ARGV)
    assert cfg.head and cfg.nodes == 2 and cfg.address == f"{HEAD}:6379"
    assert cfg.driver == ("python", "-m", "cairn.trainer.raydriver", "m:f", "--", "--steps", "4")
    assert cfg.temp_dir == podenv.RAY_TEMP_DIR
    assert (cfg.num_cpus, cfg.num_gpus, cfg.object_store_bytes, cfg.version) == (
        None,
        None,
        None,
        None,
    )


def test_head_start_command() -> None:
    cfg = raynode_plan.config(
        _env(0, **{podenv.RAY_NUM_CPUS: "2", podenv.RAY_OBJECT_STORE_BYTES: "100000000"}), ARGV
    )
    assert raynode_plan.start_argv(cfg, "/py") == [
        "/py",
        "-m",
        "ray.scripts.scripts",
        "start",
        "--block",
        "--head",
        "--port=6379",
        "--include-dashboard=false",
        "--temp-dir=/tmp/ray",
        "--disable-usage-stats",
        "--node-ip-address=10.244.1.7",
        "--num-cpus=2",
        "--object-store-memory=100000000",
    ]


def test_a_requested_dashboard_runs_on_the_head_bound_to_the_pod_ip() -> None:
    on = {podenv.RAY_DASHBOARD: "1"}
    head = raynode_plan.start_argv(raynode_plan.config(_env(0, **on), ARGV), "/py")
    assert "--include-dashboard=true" in head and "--include-dashboard=false" not in head
    assert "--dashboard-host=10.244.1.7" in head  # never Ray's 0.0.0.0 default
    assert "--dashboard-port=8265" in head
    worker = raynode_plan.start_argv(raynode_plan.config(_env(1, **on), ARGV), "/py")
    assert not any(a.startswith("--dashboard") or "dashboard" in a for a in worker)


def test_worker_start_command_joins_the_head() -> None:
    cfg = raynode_plan.config(_env(1, **{podenv.RAY_NUM_GPUS: "1"}), ARGV)
    assert not cfg.head
    argv = raynode_plan.start_argv(cfg, "/py")
    assert f"--address={HEAD}:6379" in argv and "--head" not in argv
    assert not any(a.startswith("--include-dashboard") for a in argv)
    assert "--num-gpus=1" in argv


def test_without_pod_ip_ray_picks_the_address() -> None:
    env = _env(1)
    del env[podenv.POD_IP]
    cfg = raynode_plan.config(env, ARGV)
    assert not any(a.startswith("--node-ip-address") for a in raynode_plan.start_argv(cfg, "p"))


@pytest.mark.parametrize(
    ("env", "argv", "needle"),
    [
        ({**_env(0), podenv.NODE_RANK: "x"}, ARGV, "not an integer"),
        ({k: v for k, v in _env(0).items() if k != podenv.NNODES}, ARGV, "is not set"),
        (_env(2), ARGV, "outside 0..1"),
        ({**_env(0), podenv.MASTER_ADDR_CAIRN: ""}, ARGV, "CAIRN_MASTER_ADDR"),
        (_env(0), ["python", "x.py"], "usage"),
        (_env(0), ["--"], "no driver command"),
        ({**_env(0), raynode_plan.JOIN_TIMEOUT_ENV: "soon"}, ARGV, "not a number"),
    ],
)
def test_malformed_contract_is_a_launcher_error(
    env: dict[str, str], argv: list[str], needle: str
) -> None:
    with pytest.raises(raynode_plan.LauncherError, match=needle):
        raynode_plan.config(env, argv)


def test_version_check() -> None:
    assert raynode_plan.version_error(wanted=None, installed="2.60.0") is None
    assert raynode_plan.version_error(wanted="2.60.0", installed="2.60.0") is None
    wrong = raynode_plan.version_error(wanted="2.9.3", installed="2.60.0")
    assert wrong == "spec.ray.version is 2.9.3 but the image has ray 2.60.0"
    missing = raynode_plan.version_error(wanted=None, installed=None)
    assert missing is not None and "not installed" in missing


def test_child_env() -> None:
    cfg = raynode_plan.config(_env(0), ARGV)
    env = raynode_plan.child_env(cfg, {"PATH": "/bin"})
    assert env["RAY_ADDRESS"] == f"{HEAD}:6379"
    assert env["RAY_AUTH_MODE"] == "disabled"
    assert env["PATH"] == "/bin"
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in env
    assert env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] == "0"  # stops at once, no drain
    chosen = raynode_plan.child_env(
        cfg, {"RAY_AUTH_MODE": "token", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "30"}
    )
    assert chosen["RAY_AUTH_MODE"] == "token"
    assert chosen["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] == "0"


def test_child_env_checks_node_health_quickly_unless_the_pod_says_otherwise() -> None:
    cfg = raynode_plan.config(_env(0), ARGV)
    env = raynode_plan.child_env(cfg, {})
    assert env["RAY_health_check_period_ms"] == "1000"
    assert env["RAY_health_check_timeout_ms"] == "2000"
    assert env["RAY_health_check_failure_threshold"] == "3"
    own = raynode_plan.child_env(cfg, {"RAY_health_check_timeout_ms": "10000"})
    assert own["RAY_health_check_timeout_ms"] == "10000"
    assert own["RAY_health_check_period_ms"] == "1000"


def test_node_ip_keys_are_per_rank() -> None:
    assert raynode_plan.node_ip_key(1) == b"node-ip-1"
    assert raynode_plan.node_ip_key(12) != raynode_plan.node_ip_key(1)


@pytest.mark.parametrize(
    ("missing", "addresses", "alive", "waiting"),
    [
        # every worker alive and unacked: wait for all
        ({1, 2}, {1: "10.0.0.2", 2: "10.0.0.3"}, ["10.0.0.1", "10.0.0.2", "10.0.0.3"], {1, 2}),
        # rank 1's node is gone (its pod SIGKILLed): only rank 2 is awaited
        ({1, 2}, {1: "10.0.0.2", 2: "10.0.0.3"}, ["10.0.0.1", "10.0.0.3"], {2}),
        # no worker left alive: nothing to wait for
        ({1, 2}, {1: "10.0.0.2", 2: "10.0.0.3"}, ["10.0.0.1"], set()),
        # a rank that recorded no address is waited on (the caller's bound ends it)
        ({1, 2}, {2: "10.0.0.3"}, ["10.0.0.1"], {1}),
        ({1}, {1: None}, [], {1}),
        # acked ranks are not in `missing`: their nodes may go as they like
        (set(), {1: "10.0.0.2"}, [], set()),
        # a replacement pod with the lost pod's address is alive: waited on
        ({1}, {1: "10.0.0.2"}, ["10.0.0.1", "10.0.0.2"], {1}),
    ],
)
def test_unacked_alive(
    missing: set[int], addresses: dict[int, str | None], alive: list[str], waiting: set[int]
) -> None:
    assert raynode_plan.unacked_alive(missing, addresses, alive) == waiting


def test_worker_exits_zero_only_after_an_announced_success() -> None:
    assert raynode_plan.worker_exit(0, terminated=False) == (0, "the driver on the head succeeded")
    assert raynode_plan.worker_exit(0, terminated=True)[0] == 0
    code, reason = raynode_plan.worker_exit(3, terminated=False)
    assert code != 0 and exitcodes.follows_head(reason) and "code 3" in reason
    code, reason = raynode_plan.worker_exit(None, terminated=False)
    assert code != 0 and "vanished" in reason and not exitcodes.follows_head(reason)
    code, reason = raynode_plan.worker_exit(None, terminated=False, ray_exit=1)
    assert code != 0 and "ray start exited with code 1" in reason
    code, _ = raynode_plan.worker_exit(None, terminated=True)
    assert code == exitcodes.PREEMPTED


@pytest.mark.parametrize(
    ("raw", "code"), [(None, None), (b"0", 0), (b"143", 143), (b"x", None), (b"\xff", None)]
)
def test_parse_outcome(raw: bytes | None, code: int | None) -> None:
    assert raynode_plan.parse_outcome(raw) == code


def test_with_the_jobs_token_file_every_ray_process_uses_token_auth() -> None:
    token_file = "/var/run/cairn/ray-token/token"
    cfg = raynode_plan.config(_env(1, **{podenv.RAY_TOKEN_FILE: token_file}), ARGV)
    assert cfg.token_file == token_file
    # The user's env cannot turn auth off nor swap in another token: Ray
    # prefers an inline RAY_AUTH_TOKEN to the file, so it is removed.
    user = {"RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN": "chosen", "PATH": "/bin"}
    for env in (raynode_plan.auth_env(cfg, user), raynode_plan.child_env(cfg, user)):
        assert env["RAY_AUTH_MODE"] == "token"
        assert env["RAY_AUTH_TOKEN_PATH"] == token_file
        assert "RAY_AUTH_TOKEN" not in env
        assert env["PATH"] == "/bin"


def test_without_a_token_file_auth_is_off_unless_the_user_chose() -> None:
    cfg = raynode_plan.config(_env(0, **{podenv.RAY_TOKEN_FILE: ""}), ARGV)
    assert cfg.token_file is None
    assert raynode_plan.auth_env(cfg, {})["RAY_AUTH_MODE"] == "disabled"
    assert raynode_plan.auth_env(cfg, {"RAY_AUTH_MODE": "token"})["RAY_AUTH_MODE"] == "token"


@pytest.mark.parametrize("content", ["", "\n", "   "])
def test_an_empty_token_file_is_a_configuration_error(content: str) -> None:
    why = raynode_plan.token_error(content)
    assert why is not None and podenv.RAY_TOKEN_FILE in why


def test_a_non_empty_token_is_accepted() -> None:
    assert raynode_plan.token_error("ab" * 32 + "\n") is None


@pytest.mark.parametrize(
    ("terminated_for", "preempting", "announced", "lone"),
    [
        (None, False, None, False),  # no SIGTERM: nothing to decide
        (0.5, False, None, False),  # inside the window: the driver may still say so
        (raynode_plan.LONE_LOSS_SECONDS, False, None, True),  # this pod alone
        (60.0, False, None, True),
        (60.0, True, None, False),  # the job stops: keep Ray up for the final save
        (60.0, False, 0, False),  # the outcome is out: the usual exit path
    ],
)
def test_a_workers_sigterm_is_its_own_loss_only_without_the_drivers_flag(
    terminated_for: float | None, preempting: bool, announced: int | None, lone: bool
) -> None:
    got = raynode_plan.lone_loss(
        terminated_for=terminated_for, preempting=preempting, announced=announced
    )
    assert got is lone
