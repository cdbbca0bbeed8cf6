"""The warm launcher's argument handling (``cairn.trainer.launch``), in process.

Covers: ``-m module`` and a script become the entrypoint's (mode, target,
argv) with the script's own flags untouched; the operator's ``PET_*``
rendezvous and restart budget reach torch's ``LaunchConfig`` as with
torchrun, with the start method forced to forkserver; ``--standalone`` gets
c10d on localhost as torchrun gives it; ``--no-python`` and ``-m`` with
``--run-path`` are refused with a message naming the flag (exit non-zero,
nothing launched); the preload list (defaults, then leading ``--preload=``
names, torchrun's arguments left untouched, a bad name refused); the worker
runs a module or script with ``sys.argv`` as ``python -m`` would (a module
the fork server preloaded too), returns on ``sys.exit(0)`` and leaves with
any other code; the console script is declared in pyproject; a group's
restart gives its surviving workers seconds, not torch's 30, to exit (the
agent's own shutdown keeps 30; a torch without the methods keeps its stop);
the c10d rendezvous polls every 0.1 s for small jobs (torch's 1 s from 100
nodes), only its fixed poll and state cache shortened (a real two-node
rendezvous under the patch: tests/integration/trainer/test_launch_rendezvous.py);
a failed worker's traceback is logged as the message's text (no ``exc_info``
left for torch's formatter, whose import of torch._dynamo it avoids:
tests/integration/trainer/test_launch_failure_log.py), once per logger.
The launch itself (fork
server, restarts on the devcluster) is covered by
tests/e2e/test_torchrun_inplace.py.
"""

import importlib
import logging
import pathlib
import signal
import sys
import tomllib
import typing

import pytest

from cairn.trainer import launch

pytestmark = pytest.mark.torch

ROOT = pathlib.Path(__file__).resolve().parents[3]
OPERATOR_ENV = {
    "PET_NNODES": "2",
    "PET_NPROC_PER_NODE": "1",
    "PET_RDZV_BACKEND": "c10d",
    "PET_RDZV_ENDPOINT": "job-a1-n0.job:29400",
    "PET_RDZV_ID": "uid-a1",
    "PET_RDZV_CONF": "is_host=1",
    "PET_MAX_RESTARTS": "2",
}


@pytest.fixture
def operator_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in OPERATOR_ENV.items():
        monkeypatch.setenv(name, value)


def test_module_target_keeps_its_own_flags(operator_env: None) -> None:
    config, entry = launch.plan(["-m", "cairn.trainer.reference", "--steps", "60", "-m", "x"])
    assert entry == ["module", "cairn.trainer.reference", "--steps", "60", "-m", "x"]
    assert config.start_method == "forkserver"


def test_operator_rendezvous_and_budget_reach_the_config(operator_env: None) -> None:
    config, _ = launch.plan(["-m", "cairn.trainer.reference"])
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 1)
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("c10d", "job-a1-n0.job:29400")
    assert (config.run_id, config.max_restarts) == ("uid-a1", 2)
    assert config.rdzv_configs["is_host"] == "1"
    assert config.monitor_interval == pytest.approx(0.02)  # 2 nodes: the rendezvous poll


def test_a_monitor_interval_the_user_gave_is_kept(operator_env: None) -> None:
    config, _ = launch.plan(["--monitor-interval", "0.5", "-m", "cairn.trainer.reference"])
    assert config.monitor_interval == pytest.approx(0.5)


def test_script_target(operator_env: None) -> None:
    _, entry = launch.plan(["--max-restarts", "0", "/abs/train.py", "--lr", "1"])
    assert entry == ["script", "/abs/train.py", "--lr", "1"]


def test_standalone_gets_a_local_c10d_rendezvous() -> None:
    config, _ = launch.plan(["--standalone", "--nproc-per-node", "2", "train.py"])
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("c10d", "localhost:0")
    assert config.run_id and config.nproc_per_node == 2


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--no-python", "/bin/train"], "--no-python"),
        (["-m", "--run-path", "/abs/train.py"], "--run-path"),
    ],
    ids=["no-python", "module-and-run-path"],
)
def test_refused_flags_exit_with_the_reason(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        launch.main(["--standalone", *argv])
    assert flag in str(exited.value.code) and exited.value.code != 0


def test_preload_defaults_then_leading_flags() -> None:
    argv = [
        "--preload= cairn.trainer.reference, torch ,",
        "--preload=a.b",
        "-m",
        "m",
        "--preload=x",
    ]
    names, rest = launch.split_preload(argv)
    assert names[: len(launch.DEFAULT_PRELOAD)] == list(launch.DEFAULT_PRELOAD)
    assert names.count("torch") == 1 and names[-2:] == ["cairn.trainer.reference", "a.b"]
    assert rest == ["-m", "m", "--preload=x"]  # the target's own flags stay its own
    assert launch.split_preload(["t.py"]) == (list(launch.DEFAULT_PRELOAD), ["t.py"])


@pytest.mark.parametrize("bad", ["os; rm -rf /", "../x", "a..b"])
def test_preload_refuses_what_is_not_a_module_name(bad: str) -> None:
    with pytest.raises(launch.LaunchError, match="--preload"):
        launch.split_preload([f"--preload={bad}", "t.py"])


def _program(tmp_path: pathlib.Path, exit_code: str) -> pathlib.Path:
    path = tmp_path / "warmprog.py"
    path.write_text(
        "import pathlib, sys\n"
        "pathlib.Path(sys.argv[1]).write_text(repr((__name__, sys.argv[2:])))\n"
        f"sys.exit({exit_code})\n"
    )
    return path


@pytest.mark.parametrize("mode", ["module", "script"])
def test_worker_runs_the_target_as_main_and_returns_on_exit_zero(
    mode: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    program = _program(tmp_path, "0")
    monkeypatch.chdir(tmp_path)  # python -m finds the module from the cwd
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "warmprog", raising=False)
    target = "warmprog" if mode == "module" else str(program)
    seen = tmp_path / "seen"
    launch.run_worker(mode, target, str(seen), "--a", "1")  # returns: a success
    assert seen.read_text() == repr(("__main__", ["--a", "1"]))


def test_worker_runs_a_preloaded_module_as_main_without_runpy_warning(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fork server may have imported the target (--preload): python -m semantics
    still hold, and runpy's "found in sys.modules" warning (an error here) is not raised."""
    (tmp_path / "warmmain.py").write_text(
        "import pathlib, sys\nif __name__ == '__main__':\n"
        "    pathlib.Path(sys.argv[1]).write_text('ran as main')\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    monkeypatch.delitem(sys.modules, "warmmain", raising=False)
    importlib.import_module("warmmain")  # what the fork server's preload did
    launch.run_worker("module", "warmmain", str(tmp_path / "seen"))
    assert (tmp_path / "seen").read_text() == "ran as main"


@pytest.mark.parametrize("code", ["3", "'bad config'"])
def test_worker_leaves_with_any_other_exit(
    code: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    program = _program(tmp_path, code)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(SystemExit) as exited:
        launch.run_worker("script", str(program), str(tmp_path / "seen"))
    assert exited.value.code == eval(code)


def test_console_script_is_declared() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["cairn-torchrun"] == "cairn.trainer.launch:main"


class _Agent:
    """The two methods of torch's LocalElasticAgent the launcher wraps, recording."""

    def __init__(self) -> None:
        self.stops: list[tuple[int, float]] = []

    def _restart_workers(self, worker_group: object) -> None:
        self._shutdown()  # torch: _stop_workers -> _shutdown(), then a new rendezvous

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: float = 30) -> None:
        self.stops.append((death_sig, timeout))


def test_a_restarted_groups_workers_are_killed_at_once_not_after_half_a_minute() -> None:
    agent_class = type("Agent", (_Agent,), {})
    assert launch.stop_quickly_on_restart(agent_class, reap_seconds=2)
    assert launch.stop_quickly_on_restart(agent_class, reap_seconds=2)  # wrapped once
    agent = agent_class()
    agent._restart_workers(object())  # a worker failed or a node joined: restart in place
    agent._shutdown()  # the agent's own end (the pod's SIGTERM): torch's SIGTERM and 30 s
    agent._shutdown(signal.SIGINT, 5)
    assert agent.stops == [(signal.SIGKILL, 2), (signal.SIGTERM, 30), (signal.SIGINT, 5)]
    assert not agent.cairn_restarting


def test_a_restart_that_raises_leaves_the_agents_own_shutdown_as_torchs() -> None:
    class Failing(_Agent):
        def _restart_workers(self, worker_group: object) -> None:
            self._shutdown()
            raise RuntimeError("rendezvous closed")

    agent_class = type("Agent", (Failing,), {})
    assert launch.stop_quickly_on_restart(agent_class)
    agent = agent_class()
    with pytest.raises(RuntimeError):
        agent._restart_workers(object())
    agent._shutdown()
    assert agent.stops == [(signal.SIGKILL, launch.RESTART_REAP_SECONDS), (signal.SIGTERM, 30)]


def test_an_agent_without_the_methods_keeps_torchs_stop() -> None:
    assert not launch.stop_quickly_on_restart(type("Bare", (), {}))


def test_the_launcher_wraps_torchs_agent() -> None:
    """The methods exist in the locked torch (a rename would silently keep 30 s)."""
    from torch.distributed.elastic.agent.server import local_elastic_agent

    agent_class = type("Agent", (local_elastic_agent.LocalElasticAgent,), {})
    assert launch.stop_quickly_on_restart(agent_class)


class _State:
    def __init__(self, wait: set[str], redundant: set[str]) -> None:
        self.wait_list, self.redundancy_list = wait, redundant


class _Handler:
    """torch's DynamicRendezvousHandler as far as the launcher reads it."""

    def __init__(self, state: _State) -> None:
        self._state_holder = type("Holder", (), {"state": state})()

    def num_nodes_waiting(self) -> int:
        return len(self._state_holder.state.wait_list)


def test_a_replacement_on_the_redundancy_list_counts_as_waiting() -> None:
    # The round still lists the lost node, so the replaced pod's agent is
    # "redundant": the survivors restart now, not when the lost node expires.
    handler_class = type("Handler", (_Handler,), {})
    assert launch.replacement_counts_as_waiting(handler_class)
    assert launch.replacement_counts_as_waiting(handler_class)  # wrapped once
    assert handler_class(_State(set(), set())).num_nodes_waiting() == 0
    assert handler_class(_State({"a"}, set())).num_nodes_waiting() == 1
    assert handler_class(_State(set(), {"n1-new"})).num_nodes_waiting() == 1
    assert not launch.replacement_counts_as_waiting(type("Bare", (), {}))


def test_the_launcher_wraps_torchs_c10d_handler() -> None:
    """The method and the state's lists exist in the locked torch."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    state = dynamic_rendezvous._RendezvousState()
    assert isinstance(state.wait_list, set) and isinstance(state.redundancy_list, set)
    handler_class = type("Handler", (dynamic_rendezvous.DynamicRendezvousHandler,), {})
    assert launch.replacement_counts_as_waiting(handler_class)


@pytest.mark.parametrize(
    ("nodes", "seconds"),
    [(1, 0.02), (2, 0.02), (4, 0.04), (10, 0.1), (25, 0.25), (100, 1.0), (5000, 1.0)],
)
def test_the_rendezvous_poll_shrinks_only_for_small_jobs(nodes: int, seconds: float) -> None:
    # Every agent together reads the store about as often as torch's 1 s poll at 100 nodes.
    assert launch.rendezvous_poll_seconds(nodes) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("argv", "environ", "seconds"),
    [
        ([], {}, 0.02),  # not given: the rendezvous poll, shorter than torch's 0.1 s
        (["--monitor-interval", "5"], {}, 0.1),  # given: torch's parse of it is kept
        (["--monitor_interval=0.5"], {}, 0.1),
        ([], {"PET_MONITOR_INTERVAL": "0.5"}, 0.1),
        (["--monitor-intervals"], {}, 0.02),  # another flag's name
    ],
)
def test_the_agents_monitor_interval_follows_the_poll_unless_given(
    argv: list[str], environ: dict[str, str], seconds: float
) -> None:
    assert launch.monitor_seconds(0.1, argv, environ, 0.02) == pytest.approx(seconds)


def test_a_poll_longer_than_torchs_monitor_interval_leaves_it() -> None:
    assert launch.monitor_seconds(0.1, [], {}, 1.0) == pytest.approx(0.1)


def test_a_monitor_interval_given_by_an_abbreviated_flag_is_kept() -> None:
    # torch's parser takes "--monitor 0.5" for --monitor-interval: its value tells.
    assert launch.monitor_seconds(0.5, ["--monitor", "0.5"], {}, 0.02) == pytest.approx(0.5)


class _Holder:
    """torch's _BackendRendezvousStateHolder as far as the launcher touches it."""

    def __init__(self, backend: object, settings: object, cache_duration: float = 1) -> None:
        self.cache_duration = cache_duration


def _rendezvous_module(delays: list[object]) -> object:
    def delay(seconds: object) -> None:  # torch passes it by keyword
        delays.append(seconds)

    module = type(sys)("fake_dynamic_rendezvous")
    module._delay = delay  # type: ignore[attr-defined]
    module._BackendRendezvousStateHolder = type("Holder", (_Holder,), {})  # type: ignore[attr-defined]
    return module


def test_the_rendezvous_poll_and_state_cache_follow_the_given_seconds() -> None:
    delays: list[object] = []
    module = _rendezvous_module(delays)
    assert launch.rendezvous_polls_quickly(module, seconds=0.1)
    assert launch.rendezvous_polls_quickly(module, seconds=0.1)  # wrapped once
    module._delay(seconds=1)  # type: ignore[attr-defined]  # the SYNC poll
    module._delay(seconds=(0, 0.3))  # type: ignore[attr-defined]  # the first round's skew: kept
    module._delay(seconds=0.5)  # type: ignore[attr-defined]  # a compare-and-set backoff: kept
    assert delays == [0.1, (0, 0.3), 0.5]
    holder = module._BackendRendezvousStateHolder  # type: ignore[attr-defined]
    assert holder(object(), object()).cache_duration == 0.1  # torch's default: shortened
    assert holder(object(), object(), cache_duration=3).cache_duration == 3  # a given one: kept


def test_a_rendezvous_without_the_functions_keeps_torchs_poll() -> None:
    assert not launch.rendezvous_polls_quickly(type(sys)("bare"), seconds=0.1)
    module = type(sys)("no_cache")
    module._delay = lambda seconds: None  # type: ignore[attr-defined]
    module._BackendRendezvousStateHolder = type(  # type: ignore[attr-defined]
        "Holder", (), {"__init__": lambda self, backend, settings: None}
    )
    assert not launch.rendezvous_polls_quickly(module, seconds=0.1)


def _record(exc_info: typing.Any) -> logging.LogRecord:
    return logging.LogRecord(
        "torch.distributed.elastic.multiprocessing.api",
        logging.ERROR,
        "api.py",
        836,
        "failed (exitcode: %s) local_rank: %s",
        (-9, 0),
        exc_info,
    )


def test_a_failed_workers_traceback_becomes_the_messages_text() -> None:
    try:
        raise RuntimeError("process 0 terminated with signal SIGKILL")
    except RuntimeError:
        record = _record(sys.exc_info())
    assert launch.TracebackAsText().filter(record)
    assert record.exc_info is None and record.exc_text is None and record.args is None
    message = record.getMessage().splitlines()
    assert message[0] == "failed (exitcode: -9) local_rank: 0"
    assert message[1] == "Traceback (most recent call last):"
    assert message[-1] == "RuntimeError: process 0 terminated with signal SIGKILL"
    assert (record.levelno, record.lineno) == (logging.ERROR, 836)


def test_a_record_without_a_traceback_is_left_as_it_is() -> None:
    record = _record(None)
    assert launch.TracebackAsText().filter(record)
    assert (record.msg, record.args) == ("failed (exitcode: %s) local_rank: %s", (-9, 0))


def test_the_filter_is_added_once_per_logger() -> None:
    name = "cairn.tests.launch.failures"
    launch.log_tracebacks_as_text([name])
    launch.log_tracebacks_as_text([name])
    filters = logging.getLogger(name).filters
    assert sum(isinstance(f, launch.TracebackAsText) for f in filters) == 1
    assert launch.FAILURE_LOGGERS == ("torch.distributed.elastic.multiprocessing.api",)
