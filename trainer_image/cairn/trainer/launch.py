"""Warm restarts for torchrun: a drop-in launcher whose workers fork from a pre-imported server.

    python -m cairn.trainer.launch [--preload=MODULES] <torchrun args> -m my.module <args>
    cairn-torchrun [--preload=MODULES] <torchrun args> train.py <script args>

Plain ``torchrun -m mod`` starts each worker as a new interpreter
(``Popen(sys.executable -u -m mod)``; its ``--start-method`` applies only to
function entrypoints), so every in-place restart pays the interpreter start,
``import torch`` and the trainer's imports again. This launcher takes the same
arguments, parsed by torch's own parser (``torch.distributed.run``), and hands
torch's elastic agent a FUNCTION entrypoint (`run_worker`) with the
``forkserver`` start method: the fork server is started once per pod, before
the first rendezvous, with torch, ``torch.distributed``, inductor's config and
the checkpoint library imported (plus the modules ``--preload=a,b`` names, given first,
e.g. the trainer module itself when importing it has no side effects), and
every worker, first and restarted, is a fork of it. Everything
else is torchrun's agent unchanged: rendezvous, ``maxInPlaceRestarts``
(``--max-restarts``), the per-worker environment (``RANK``,
``TORCHELASTIC_RESTART_COUNT``, ... set by the agent in the child before the
entrypoint runs), SIGTERM forwarding, failure summaries and the exit code.

Differences from plain torchrun, all deliberate: ``--no-python`` is refused (a
binary cannot fork warm); ``--start-method`` is always ``forkserver``; a
worker's ``sys.exit(0)`` (or ``None``) is a success, any other exit code is
the worker's exit code, as with a subprocess; the surviving workers of a
group restarted in place are SIGKILLed at once, not given 30 s after a
SIGTERM (`stop_quickly_on_restart`: a survivor blocked on its dead peer held
every restart for the full 30 s, and has nothing to save); a node waiting
on c10d's redundancy list counts as waiting (`replacement_counts_as_waiting`:
a pod replaced in place is seen at once, not after its lost predecessor's
heartbeats expire); the agents poll the c10d rendezvous, and watch their
workers, every 0.02 s at 2 nodes, 0.1 s at 10, instead of every second and
every 0.1 s (`rendezvous_poll_seconds`: both waits of a restart's round
were polls; torch's 1 s from 100 nodes on); and the agent logs a failed
worker's traceback as text (`TracebackAsText`: torch's log formatter imports
``torch._dynamo`` the first time it formats a traceback, 1.3 s in the agent
at the first restart of every pod). Two more things make a worker's first
second shorter, neither visible to the trainer: a worker other than rank 0
waits for rank 0's store by connecting every 10 ms before the trainer runs
(`cairn.trainer.storewait`: the group's workers start together, and one
that tried before rank 0's store listened waited out torch's ~1 s connect
backoff), and the fork server, after its preloads, fills botocore's model
cache and freezes its heap out of the garbage collector's reach
(`cairn.trainer.forkprep`, imported last: `server_preload`).
"""

from __future__ import annotations

import inspect
import logging
import multiprocessing
import os
import runpy
import signal
import sys
import tempfile
import typing
from multiprocessing import forkserver, util

from cairn.trainer import storewait

log = logging.getLogger(__name__)

PRELOAD_FLAG = "--preload="
"""The launcher's own option, before torchrun's: extra modules (comma separated) the fork
server imports before any worker forks. (An env variable would be CAIRN_*, which the
TrainingJob API reserves for the operator.)"""

DEFAULT_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.elastic.multiprocessing",
    "cairn.checkpoint.manager",
    # What torch.use_deterministic_algorithms and torch.compile import on
    # their first call (inductor's config: sympy, mpmath, ~900 modules). A
    # reproducible trainer calls the first at every start: measured with the
    # reference trainer under this launcher, 0.9 s of each restarted worker's
    # start was that import. Costs the fork server ~0.5 s (overlapping the
    # first rendezvous) and ~100 MiB, shared with its forks.
    "torch._inductor.config",
    # Rank 0's status feed under the operator (imported lazily there, about
    # 0.2 s a worker); skipped by the fork server where not installed.
    "kubernetes.client",
    "kubernetes.config",
)
"""What every Cairn trainer imports: torch and the checkpoint library."""

PREP_MODULE = "cairn.trainer.forkprep"
"""Imported by the fork server after every preload: fills botocore's model cache
and moves the server's heap out of the garbage collector's reach (a fork's full
collection walked it: 0.23 s)."""

START_METHOD = "forkserver"
SOCKET_DIR_MAX = 70
"""The longest temp dir under which multiprocessing's fork-server socket
(``<dir>/pymp-XXXXXXXX/listener-XXXXXXXX``) fits AF_UNIX's 107 bytes."""


class LaunchError(ValueError):
    """Arguments this launcher cannot honour (the message says which and why)."""


def split_preload(argv: list[str]) -> tuple[list[str], list[str]]:
    """The fork server's preload list (the defaults, then every leading ``--preload=``'s
    names) and torchrun's arguments (the rest, untouched). Pure."""
    extra: list[str] = []
    rest = list(argv)
    while rest and rest[0].startswith(PRELOAD_FLAG):
        names = rest.pop(0).removeprefix(PRELOAD_FLAG).split(",")
        extra += [name.strip() for name in names if name.strip()]
    for name in extra:
        if not all(part.isidentifier() for part in name.split(".")):
            raise LaunchError(f"{PRELOAD_FLAG}: {name!r} is not a module name")
    return list(dict.fromkeys([*DEFAULT_PRELOAD, *extra])), rest


def server_preload(preload: list[str]) -> list[str]:
    """What the fork server imports, in order: `preload`, then `PREP_MODULE`
    (it must come last: it warms and freezes what the others loaded). Pure."""
    return [*(name for name in preload if name != PREP_MODULE), PREP_MODULE]


def worker_args(args: typing.Any) -> list[str]:
    """The entrypoint's arguments for torch's parsed ``args``: mode, target, then argv. Pure
    but for torch's ``macros`` constant (the agent puts each worker's local rank there)."""
    from torch.distributed.elastic.utils.api import macros
    from torch.distributed.run import get_use_env

    if args.no_python:
        raise LaunchError("--no-python: a binary cannot fork warm; use torchrun for it")
    if args.module and args.run_path:
        raise LaunchError("--module and --run-path name the target twice; give one")
    mode = "module" if args.module else "script"
    out = [mode, args.training_script]
    if not get_use_env(args):
        out.append(f"--local-rank={macros.local_rank}")
    return [*out, *args.training_script_args]


def run_worker(mode: str, target: str, *argv: str) -> None:
    """The worker: runs the user's module or script as ``python -u [-m] target argv`` would.

    Runs in a fork of the server, after the agent's ``_wrap`` has set this
    worker's environment. A ``SystemExit`` of 0 or None returns (the agent
    counts a worker that returned); any other leaves the process with its code.
    """
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):  # -u: every line reaches the pod log at once
            stream.reconfigure(line_buffering=True, write_through=True)
    sys.argv = [target, *argv]
    # sys.path[0] as the interpreter sets it: the cwd for -m, the script's folder otherwise.
    first = os.getcwd() if mode == "module" else os.path.dirname(os.path.abspath(target))
    if first not in sys.path[:1]:
        sys.path.insert(0, first)
    # Every worker of a group starts at once: without this, a rank that tries
    # rank 0's store before it listens waits out torch's ~1 s connect backoff.
    storewait.wait_for_master_store(os.environ)
    try:
        if mode == "module":
            # As `python -m`: the target runs as __main__ only. A preloaded copy
            # under its own name goes (its imports stay loaded), else runpy warns.
            sys.modules.pop(target, None)
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as done:
        if done.code not in (None, 0):
            raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _standalone_defaults(args: typing.Any) -> None:
    """What ``torch.distributed.run.run`` does to the args before ``config_from_args``."""
    import uuid

    from torch.distributed.run import parse_min_max_nnodes

    if args.standalone:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = (
            "c10d",
            "localhost:0",
            str(uuid.uuid4()),
        )
    elif (
        args.rdzv_backend == "static"
        and not args.rdzv_endpoint
        and args.master_port is None
        and parse_min_max_nnodes(args.nnodes)[1] == 1
    ):
        args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500


def plan(argv: list[str]) -> tuple[typing.Any, list[str]]:
    """torchrun's ``LaunchConfig`` for ``argv`` (forkserver, the agent's monitor
    interval at most the rendezvous poll unless given) and the entrypoint's arguments.

    Reads what torch's parser reads: ``argv`` and the ``PET_*`` variables the
    operator sets (rendezvous, ``--max-restarts``); may set ``OMP_NUM_THREADS``
    as torchrun does.
    """
    from torch.distributed import run as torchrun

    args = torchrun.get_args_parser().parse_args(argv)
    entry_args = worker_args(args)
    _standalone_defaults(args)
    config, _cmd, _cmd_args = torchrun.config_from_args(args)
    config.start_method = START_METHOD
    poll = rendezvous_poll_seconds(config.max_nodes)
    config.monitor_interval = monitor_seconds(config.monitor_interval, argv, os.environ, poll)
    return config, entry_args


def _short_socket_dir() -> None:
    """Put multiprocessing's temp dir (the fork server's socket) under /tmp when
    ``TMPDIR`` is too long for an AF_UNIX path (the devcluster's per-pod TMPDIR
    is; Python 3.11 fails ``bind`` with "AF_UNIX path too long")."""
    if len(tempfile.gettempdir()) <= SOCKET_DIR_MAX:
        return
    saved = tempfile.tempdir
    tempfile.tempdir = "/tmp"
    try:
        util.get_temp_dir()  # created now, removed at exit by multiprocessing
    finally:
        tempfile.tempdir = saved


RESTART_REAP_SECONDS = 5.0
"""How long the agent waits for the SIGKILLed workers of a group it restarts in
place to be reaped (a process stuck in the kernel is then abandoned, as torch
does after its own SIGKILL).

A survivor is SIGKILLed at once, with no SIGTERM grace (torch: SIGTERM, then
30 s, as for a final shutdown): it is blocked on its dead peer (it never
reaches the step boundary where SIGTERM's final checkpoint would start) and
has nothing to save: the new group restores the newest committed step, and a
commit is a rename, so a kill mid-write leaves only a temporary folder the
next start removes (a memory replica cut short fails its CRC32C at the
peer). The grace was 2 s until 2026-11-28, then 0.5 s, then 0.1 s: in every
kill measured the survivor used all of it ("Unable to shutdown process ...
via 15"), so it only delayed the restart."""


def stop_quickly_on_restart(
    agent_class: typing.Any, *, reap_seconds: float = RESTART_REAP_SECONDS
) -> bool:
    """Make `agent_class` (torch's LocalElasticAgent) SIGKILL the surviving
    workers of a group it restarts in place at once, waiting up to
    `reap_seconds` for them to be reaped, instead of a SIGTERM and 30 s.

    A group is restarted because a worker failed or a node (re)joined: every
    worker restarts from the newest committed step, so a survivor has nothing
    left to save, and the checkpoint library takes SIGTERM for a preemption
    (a final checkpoint at the next step boundary): a survivor blocked on its
    dead peer (the writer waiting for the peer's files, which never come)
    held every in-place restart for the full 30 s (measured on the devcluster:
    "Unable to shutdown process ... via 15, forcefully exiting via 9" 30.0 s
    after the SIGTERM, the first kill of a run taking 35.8 s instead of ~6).
    A shutdown of the agent itself (the pod's SIGTERM, forwarded) keeps
    torch's SIGTERM and 30 s: there the final checkpoint is the point. False
    (torch's behaviour kept) when this torch has no such methods."""
    restart = getattr(agent_class, "_restart_workers", None)
    shutdown = getattr(agent_class, "_shutdown", None)
    if restart is None or shutdown is None:
        return False
    if getattr(restart, "cairn_quick_stop", False):
        return True

    def restart_workers(self: typing.Any, worker_group: typing.Any) -> None:
        self.cairn_restarting = True
        try:
            restart(self, worker_group)
        finally:
            self.cairn_restarting = False

    def shutdown_workers(
        self: typing.Any, death_sig: signal.Signals = signal.SIGTERM, timeout: float = 30
    ) -> None:
        if getattr(self, "cairn_restarting", False):
            # torch's close: death_sig, a wait of `timeout` for the processes
            # to end, SIGKILL to those left, then up to `timeout` to reap each.
            death_sig, timeout = signal.SIGKILL, min(timeout, reap_seconds)
        shutdown(self, death_sig, timeout)

    restart_workers.cairn_quick_stop = True  # type: ignore[attr-defined]
    setattr(agent_class, "_restart_workers", restart_workers)  # noqa: B010 (private)
    setattr(agent_class, "_shutdown", shutdown_workers)  # noqa: B010 (private)
    return True


def replacement_counts_as_waiting(handler_class: typing.Any) -> bool:
    """Make `handler_class` (torch's c10d DynamicRendezvousHandler) count the nodes
    on its redundancy list as waiting for the next round.

    A pod the operator replaced in place joins while the round still lists the
    lost node as a participant: the round is full, so c10d puts the new node on
    the redundancy list, and the survivors' agents (which restart their workers
    only when ``num_nodes_waiting() > 0``) wait until the lost node's heartbeats
    expire (measured on the devcluster: ~4 s of a 12.6 s recovery, the survivor's
    worker blocked on its dead peer meanwhile). A job has a fixed number of
    nodes, so a redundant node is a replacement: restarting now starts a new
    round the replacement joins as a participant (c10d moves it off the list
    once the round has room), without the lost node. False (torch's behaviour
    kept) when this torch has no such method or state."""
    waiting = getattr(handler_class, "num_nodes_waiting", None)
    if waiting is None:
        return False
    if getattr(waiting, "cairn_counts_redundant", False):
        return True

    def num_nodes_waiting(self: typing.Any) -> int:
        count = int(waiting(self))  # syncs the state
        state = getattr(getattr(self, "_state_holder", None), "state", None)
        redundant = getattr(state, "redundancy_list", None)
        return count + (len(redundant) if redundant is not None else 0)

    num_nodes_waiting.cairn_counts_redundant = True  # type: ignore[attr-defined]
    setattr(handler_class, "num_nodes_waiting", num_nodes_waiting)  # noqa: B010
    return True


TORCH_POLL_SECONDS = 1.0
"""torch's c10d rendezvous: an agent waiting on the others re-reads the shared
state every second, and serves a read from a cache up to a second old."""
POLL_FLOOR_SECONDS = 0.02
"""The shortest poll, for jobs of 1 and 2 nodes (0.1 s until 2026-11-29 for
every job of up to 10 nodes: a 2-node restart waited out three such polls)."""
STATE_READS_PER_SECOND = 100.0
"""What a job's agents together ask of the rendezvous store at most while they
poll: torch's 1 s poll at 100 nodes."""
MONITOR_FLAGS = ("--monitor-interval", "--monitor_interval")
MONITOR_ENV = "PET_MONITOR_INTERVAL"
TORCH_MONITOR_SECONDS = 0.1
"""torchrun's default ``--monitor-interval``."""


def rendezvous_poll_seconds(max_nodes: int) -> float:
    """How often an agent re-reads the c10d rendezvous state: as many seconds
    as keep every agent together at about 100 reads a second (as torch's
    poll does at 100 nodes): 0.02 s at 2 nodes (and 1), 0.1 s at 10, torch's
    1 s from 100 nodes on. Pure."""
    return min(TORCH_POLL_SECONDS, max(POLL_FLOOR_SECONDS, max_nodes / STATE_READS_PER_SECOND))


def monitor_seconds(
    configured: float, argv: typing.Sequence[str], environ: typing.Mapping[str, str], poll: float
) -> float:
    """How often the agent checks its workers and asks the rendezvous whether a
    node waits: what the user gave (``--monitor-interval`` or its ``PET_``
    variable), else the rendezvous poll where that is shorter than torch's
    default (`configured`, 0.1 s). A restart's first two waits are this loop:
    the failed worker's agent notices its death on a tick, the survivor's
    agent the waiting node on one. Given means: the flag or the variable
    seen, or a value other than torch's default (an abbreviated flag, which
    torch's parser accepts). Pure."""
    given = (
        MONITOR_ENV in environ
        or configured != TORCH_MONITOR_SECONDS
        or any(arg == flag or arg.startswith(flag + "=") for arg in argv for flag in MONITOR_FLAGS)
    )
    return configured if given else min(configured, poll)


def rendezvous_polls_quickly(module: typing.Any, *, seconds: float) -> bool:
    """Make `module` (torch's ``dynamic_rendezvous``) poll the shared state every
    `seconds` instead of every second.

    An in-place restart is one c10d round: the agent of the failed worker
    joins the wait list, the survivors' agents see it (``num_nodes_waiting``,
    a state read served from a cache up to 1 s old), stop their workers and
    join, and the agent that joined first learns the round is complete on its
    next poll (a fixed 1 s sleep between reads). Measured on the devcluster
    (2 nodes, torch's agent log): 0.5-1.0 s from the failed agent's join to the
    survivor's "Detected 1 new nodes", and 1.25-1.28 s from the survivor's join
    to "Rendezvous complete", of a ~5.3 s recovery. Both waits are polls, so
    this shortens the poll's sleep (the ``_delay(seconds=1)`` of the op
    executor's SYNC action; the other delays, a random skew and the
    compare-and-set backoff, are kept) and the state cache (the state
    holder's ``cache_duration`` where torch leaves it at its default). A
    write (join, leave, heartbeat) never waited on either. False (torch's
    behaviour kept) when this torch has no such functions."""
    holder = getattr(module, "_BackendRendezvousStateHolder", None)
    delay = getattr(module, "_delay", None)
    if holder is None or delay is None:
        return False
    init = holder.__init__
    if "cache_duration" not in inspect.signature(init).parameters:
        return False
    if getattr(delay, "cairn_poll_seconds", None) is not None:
        return True

    poll = seconds  # torch passes `_delay` its own `seconds` by keyword

    def quick_delay(seconds: typing.Any) -> None:  # as torch's: a number or a range
        delay(seconds=poll if seconds == TORCH_POLL_SECONDS else seconds)

    def holder_init(
        self: typing.Any, backend: typing.Any, settings: typing.Any, cache_duration: float = -1
    ) -> None:
        init(self, backend, settings, poll if cache_duration == -1 else cache_duration)

    quick_delay.cairn_poll_seconds = seconds  # type: ignore[attr-defined]
    setattr(module, "_delay", quick_delay)  # noqa: B010 (private)
    setattr(holder, "__init__", holder_init)  # noqa: B010
    return True


FAILURE_LOGGERS = ("torch.distributed.elastic.multiprocessing.api",)
"""The agent's loggers that log a failed worker with its traceback (``logger.exception``
in the process context's poll: every in-place restart for a failed worker)."""


class TracebackAsText(logging.Filter):
    """Puts a record's traceback into its message, so torch's log formatter never
    sees ``exc_info``.

    torch's ``TorchLogsFormatter`` (the handler ``import torch`` installs on its
    loggers) runs ``from torch._dynamo import config`` whenever it formats a
    record with ``exc_info``: sympy, triton, functorch, DTensor's op tables,
    1.3 s and ~150 MiB the first time in a process that has only torch and the
    agent (measured here). The elastic agent logs every failed worker that way,
    so the first in-place restart of each pod's agent paid the import before
    it even joined the next round (py-spy on the devcluster's agents: 270 of
    400 samples during a run's first kill were that import, in both pods: the
    failed worker's agent and, 1.6 s later, the survivor's, whose worker had
    failed on its own meanwhile because nobody had asked it to stop): the
    first kill of a warm run took 4.4-5.8 s in five runs against 1.9-3.2 s
    for the others. The text is what logging's own formatter writes for the
    traceback; the record's level, logger and line are unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info:
            text = record.exc_text or logging.Formatter().formatException(record.exc_info)
            record.msg = f"{record.getMessage()}\n{text}"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


def log_tracebacks_as_text(names: typing.Iterable[str] = FAILURE_LOGGERS) -> None:
    """Add `TracebackAsText` to each logger of `names` (once; a logger's own
    filters survive torch re-initialising its log handlers)."""
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, TracebackAsText) for f in logger.filters):
            logger.addFilter(TracebackAsText())


def launch(config: typing.Any, entry_args: list[str], preload: list[str]) -> None:
    """Start the warm fork server, then run torch's elastic agent until the group ends."""
    from torch.distributed.elastic.agent.server import local_elastic_agent
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    from torch.distributed.launcher import api as launcher

    if not stop_quickly_on_restart(local_elastic_agent.LocalElasticAgent):
        log.warning(
            "this torch's elastic agent has no _restart_workers/_shutdown: "
            "a restarted group's workers get torch's SIGTERM and 30 s to exit"
        )
    if not replacement_counts_as_waiting(dynamic_rendezvous.DynamicRendezvousHandler):
        log.warning(
            "this torch's c10d rendezvous has no num_nodes_waiting: a pod replaced in "
            "place waits for its predecessor's heartbeats to expire"
        )
    poll = rendezvous_poll_seconds(config.max_nodes)
    if not rendezvous_polls_quickly(dynamic_rendezvous, seconds=poll):
        log.warning(
            "this torch's c10d rendezvous has no _delay/_BackendRendezvousStateHolder: "
            "agents poll the rendezvous every second"
        )
    log_tracebacks_as_text()
    multiprocessing.set_forkserver_preload(server_preload(preload))
    _short_socket_dir()
    # Started now, its imports overlap the first rendezvous; its environment is
    # the agent's (config_from_args has set OMP_NUM_THREADS), and the agent sets
    # each worker's own variables after the fork.
    forkserver.ensure_running()
    launcher.elastic_launch(config=config, entrypoint=run_worker)(*entry_args)


def main(argv: list[str] | None = None) -> None:
    """Console script ``cairn-torchrun``: exits non-zero when a worker group failed."""
    from torch.distributed.elastic.multiprocessing import errors

    try:
        preload, torchrun_argv = split_preload(sys.argv[1:] if argv is None else argv)
        config, entry_args = plan(torchrun_argv)
    except LaunchError as bad:
        sys.exit(f"cairn-torchrun: {bad}")
    # As torchrun's main: a failed group's root cause is summarised, exit 1.
    errors.record(launch)(config, entry_args, preload)


if __name__ == "__main__":
    # Through the module's own name, so the pickled entrypoint is
    # cairn.trainer.launch.run_worker and not __main__'s copy (each worker
    # re-runs the agent's __main__ as __mp_main__, guarded here).
    from cairn.trainer import launch as _launch

    _launch.main()
