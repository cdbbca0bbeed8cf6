"""The pure half of the Ray node launcher (``cairn.trainer.raynode``).

Pure: the pod's env (``cairn.api.podenv``) and argv in, the node's settings,
the ``ray start`` command line, the children's env and the exit decisions
out. No Ray import here: the launcher checks the version before it loads Ray.

Roles: node rank 0 is the head (``ray start --head``, then the driver, the
user's command), every other rank a worker (``ray start --address``). The
head announces the driver's exit code in Ray's internal KV
(``OUTCOME_NAMESPACE``/``OUTCOME_KEY``) before it stops Ray; a worker exits
0 only when it read a success there (:func:`worker_exit`).

Auth: with the job's token file (``CAIRN_RAY_TOKEN_FILE``) every Ray process
of the node runs with token auth, whatever the user's env says
(:func:`auth_env`); the head's dashboard is off unless the job asked for it,
and then bound to the pod's IP (docs/security.md, "Ray token auth").
"""

from __future__ import annotations

import dataclasses
import typing

from cairn.api import exitcodes, podenv

OUTCOME_NAMESPACE = b"cairn"
OUTCOME_KEY = b"driver-exit-code"
NO_DRAIN_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"
PREEMPTING_KEY = b"driver-preempting"
"""Written by the driver (same namespace) once it got SIGTERM: the job is
stopping as a whole, so a worker that gets SIGTERM too keeps its Ray node up
for the final checkpoint (`lone_loss`)."""
NODE_IP_KEY_PREFIX = b"node-ip-"
"""A worker's pod IP (its Ray node's address), written by the worker once its
Ray node is up (same namespace), so the head can tell a worker whose node is
gone from one that has yet to acknowledge the outcome (`unacked_alive`)."""
HEALTH_CHECK_ENV: typing.Mapping[str, str] = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "2000",
    "RAY_health_check_failure_threshold": "3",
}
"""How fast the head's GCS declares a silent node dead (Ray's defaults: every
3 s, 10 s deadline, 5 misses). A worker pod killed outright (SIGKILL, its node
gone) closes no connection the GCS acts on: the driver learns of it only from
these checks, 30 s after the kill with Ray's defaults (seen on the
devcluster: the first check hung for its 10 s deadline, four more failed 3 s
apart). With these a check starts 1 s after the last one ended and a silent
node fails it after 2 s, so it counts as dead after 3 failed checks, about
9 s (15 s with 5, seen on the devcluster); an alive raylet counts as dead
only if it leaves three checks in a row unanswered for 2 s. A pod's own
values win (`child_env`)."""
LONE_LOSS_SECONDS = 5.0
"""How long a worker that got SIGTERM waits for the driver's preempting flag
before it takes the SIGTERM for its own pod's loss. The driver writes the flag
within about 0.2 s of its own SIGTERM (its watch loop), which the operator's
deletes of a job's pods send within milliseconds of each other."""
TEMP_DIR_ENV = "CAIRN_RAY_TEMP_DIR"
"""Overrides ``podenv.RAY_TEMP_DIR`` (tests outside a pod; keep it short: Ray's
Unix socket paths under it must stay below 107 bytes)."""
JOIN_TIMEOUT_ENV = "CAIRN_RAY_JOIN_TIMEOUT_SECONDS"
JOIN_TIMEOUT_DEFAULT = 300.0
"""How long the head waits for every node, and a worker for the head's GCS."""
HEAD_LOST_EXIT = 1
"""A worker whose head vanished without announcing the driver's outcome."""
DRIVER_FAILED_EXIT = 1
"""A worker whose head announced a failed driver (the head's pod carries the cause)."""
NOT_JOINED_EXIT = 1
"""The head gave up waiting for the workers (retryable: a new attempt may work)."""


class LauncherError(ValueError):
    """The pod contract is malformed: a configuration error (exit 78)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class NodeConfig:
    """What one pod's launcher does."""

    head: bool
    rank: int
    nodes: int
    head_host: str
    port: int
    node_ip: str | None
    temp_dir: str
    num_cpus: int | None
    num_gpus: int | None
    object_store_bytes: int | None
    version: str | None
    join_timeout_seconds: float
    token_file: str | None = None
    """The job's Ray auth token (``CAIRN_RAY_TOKEN_FILE``); None: no token auth."""
    dashboard: bool = False
    """The head runs Ray's dashboard, bound to ``node_ip`` (``CAIRN_RAY_DASHBOARD``)."""
    driver: tuple[str, ...]
    """The user's command and args (run on the head only)."""

    @property
    def address(self) -> str:
        return f"{self.head_host}:{self.port}"


def _int(env: typing.Mapping[str, str], name: str, default: int | None = None) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise LauncherError(f"{name}={raw!r} is not an integer") from None


def _required_int(env: typing.Mapping[str, str], name: str) -> int:
    value = _int(env, name)
    if value is None:
        raise LauncherError(f"{name} is not set (the operator sets it in every pod)")
    return value


def driver_argv(argv: typing.Sequence[str]) -> tuple[str, ...]:
    """The user's command after ``--``."""
    if "--" not in argv:
        raise LauncherError("usage: python -m cairn.trainer.raynode -- <command> [args...]")
    command = tuple(argv[list(argv).index("--") + 1 :])
    if not command:
        raise LauncherError("no driver command after --")
    return command


def config(env: typing.Mapping[str, str], argv: typing.Sequence[str]) -> NodeConfig:
    """The node's settings from the pod's env and argv; LauncherError if malformed."""
    rank = _required_int(env, podenv.NODE_RANK)
    nodes = _required_int(env, podenv.NNODES)
    if not 0 <= rank < nodes:
        raise LauncherError(f"{podenv.NODE_RANK}={rank} outside 0..{nodes - 1}")
    head_host = env.get(podenv.MASTER_ADDR_CAIRN, "")
    if not head_host:
        raise LauncherError(f"{podenv.MASTER_ADDR_CAIRN} is not set")
    timeout = env.get(JOIN_TIMEOUT_ENV)
    try:
        join_timeout = float(timeout) if timeout else JOIN_TIMEOUT_DEFAULT
    except ValueError:
        raise LauncherError(f"{JOIN_TIMEOUT_ENV}={timeout!r} is not a number") from None
    return NodeConfig(
        head=rank == 0,
        rank=rank,
        nodes=nodes,
        head_host=head_host,
        port=_int(env, podenv.RAY_PORT, podenv.RAY_PORT_DEFAULT) or podenv.RAY_PORT_DEFAULT,
        node_ip=env.get(podenv.POD_IP) or None,
        temp_dir=env.get(TEMP_DIR_ENV) or podenv.RAY_TEMP_DIR,
        num_cpus=_int(env, podenv.RAY_NUM_CPUS),
        num_gpus=_int(env, podenv.RAY_NUM_GPUS),
        object_store_bytes=_int(env, podenv.RAY_OBJECT_STORE_BYTES),
        version=env.get(podenv.RAY_VERSION) or None,
        join_timeout_seconds=join_timeout,
        token_file=env.get(podenv.RAY_TOKEN_FILE) or None,
        dashboard=env.get(podenv.RAY_DASHBOARD) == "1",
        driver=driver_argv(argv),
    )


def version_error(*, wanted: str | None, installed: str | None) -> str | None:
    """The configuration error when the image's Ray is not the one the job asks for."""
    if installed is None:
        return "ray is not installed in the trainer image (runtime: ray needs cairn-training[ray])"
    if wanted is not None and wanted != installed:
        return f"spec.ray.version is {wanted} but the image has ray {installed}"
    return None


def _dashboard_args(cfg: NodeConfig) -> list[str]:
    """The head's dashboard flags (ray start refuses them on a worker): off unless
    asked for, then on the pod's own address, never Ray's 0.0.0.0 default."""
    if not cfg.dashboard:
        return ["--include-dashboard=false"]
    return [
        "--include-dashboard=true",
        f"--dashboard-host={cfg.node_ip or '127.0.0.1'}",
        f"--dashboard-port={podenv.RAY_DASHBOARD_PORT}",
    ]


def start_argv(cfg: NodeConfig, python: str) -> list[str]:
    """``ray start … --block`` for this node (the launcher's child, stopped by PID)."""
    argv = [python, "-m", "ray.scripts.scripts", "start", "--block"]
    if cfg.head:
        argv += ["--head", f"--port={cfg.port}", *_dashboard_args(cfg)]
    else:
        argv += [f"--address={cfg.address}"]
    argv += [f"--temp-dir={cfg.temp_dir}", "--disable-usage-stats"]
    if cfg.node_ip is not None:
        argv.append(f"--node-ip-address={cfg.node_ip}")
    if cfg.num_cpus is not None:
        argv.append(f"--num-cpus={cfg.num_cpus}")
    if cfg.num_gpus is not None:
        argv.append(f"--num-gpus={cfg.num_gpus}")
    if cfg.object_store_bytes is not None:
        argv.append(f"--object-store-memory={cfg.object_store_bytes}")
    return argv


def token_error(token: str) -> str | None:
    """Why the job's token file's content cannot be the cluster's token (None: it can)."""
    if not token.strip():
        return f"the Ray token file (${podenv.RAY_TOKEN_FILE}) is empty"
    return None


def auth_env(cfg: NodeConfig, base: typing.Mapping[str, str]) -> dict[str, str]:
    """Ray's auth variables for every process of this node, the launcher's own included.

    With the job's token file: ``RAY_AUTH_MODE=token`` and
    ``RAY_AUTH_TOKEN_PATH`` naming it, whatever the user's env says, and no
    ``RAY_AUTH_TOKEN`` (Ray prefers it to the file). Without one (the launcher
    outside a pod): off unless the user chose (with ``RAY_AUTH_MODE`` unset, a
    ``~/.ray/auth_token`` left by any other Ray on a shared home would turn it
    on for some processes only).
    """
    env = dict(base)
    if cfg.token_file is not None:
        env[podenv.RAY_AUTH_MODE] = "token"
        env[podenv.RAY_AUTH_TOKEN_PATH] = cfg.token_file
        env.pop(podenv.RAY_AUTH_TOKEN, None)
    else:
        env.setdefault(podenv.RAY_AUTH_MODE, "disabled")
    return env


def child_env(cfg: NodeConfig, base: typing.Mapping[str, str]) -> dict[str, str]:
    """Env of ``ray start`` and the driver: the pod's, plus what Ray needs here.

    ``RAY_ADDRESS`` makes the driver's ``ray.init()`` join this cluster;
    Ray's auth as :func:`auth_env` says; no usage stats (no egress). Never set
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: ``ray start --address`` then
    refuses to join ("Multi-node Ray clusters are not supported").
    No drain on SIGTERM (``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0``, even
    when the pod sets it): ``ray start --block`` would otherwise wait up to
    30 s for its actors to finish before stopping its node, and a rank actor
    only finishes with the job: a worker pod lost alone trained on through it
    (seen on the devcluster: 15.5 s of drain, the job ended meanwhile), so
    the driver could not see the node gone. Cairn stops a node only when the
    driver is done with it or the pod is going alone (`lone_loss`).
    Ray's node health checks as `HEALTH_CHECK_ENV` unless the pod sets them.
    """
    env = auth_env(cfg, base)
    for name, value in HEALTH_CHECK_ENV.items():
        env.setdefault(name, value)
    env["RAY_ADDRESS"] = cfg.address
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env[NO_DRAIN_ENV] = "0"
    return env


def worker_exit(
    announced: int | None, *, terminated: bool, ray_exit: int | None = None
) -> tuple[int, str]:
    """A worker's exit code and reason once its Ray node is done.

    ``announced``: the driver's exit code the head published (None: none seen).
    ``terminated``: the pod was asked to stop (SIGTERM).
    ``ray_exit``: the code of ``ray start`` when it ended on its own (None: it
    was still running when the launcher stopped it).
    """
    if announced == exitcodes.SUCCESS:
        return exitcodes.SUCCESS, "the driver on the head succeeded"
    if announced is not None:
        return DRIVER_FAILED_EXIT, (
            f"{exitcodes.FOLLOWS_HEAD_REASON}: the driver on the head exited with code {announced}"
        )
    if terminated:
        return exitcodes.PREEMPTED, "stopped (SIGTERM) before the head announced an outcome"
    if ray_exit is not None:
        return HEAD_LOST_EXIT, (
            f"ray start exited with code {ray_exit} before the head announced an outcome "
            "(its output is in this pod's log)"
        )
    return HEAD_LOST_EXIT, "the Ray head vanished without announcing the driver's outcome"


def parse_outcome(raw: bytes | None) -> int | None:
    """The announced exit code from the KV value (None: absent or unreadable)."""
    if raw is None:
        return None
    try:
        return int(raw.decode())
    except (UnicodeDecodeError, ValueError):
        return None


def joined_message(alive: int, nodes: int, waited: float) -> str:
    return f"raynode: {alive}/{nodes} Ray nodes joined after {waited:.0f}s"


def node_ip_key(rank: int) -> bytes:
    """Where worker `rank` records its Ray node's address (`NODE_IP_KEY_PREFIX`)."""
    return NODE_IP_KEY_PREFIX + str(rank).encode()


def unacked_alive(
    missing: typing.Iterable[int],
    addresses: typing.Mapping[int, str | None],
    alive: typing.Collection[str],
) -> set[int]:
    """The worker ranks the head still waits on for an acknowledgement of the
    driver's outcome: those `missing` an ack, less those whose Ray node is
    gone (their recorded address, `addresses`, is no alive node's, `alive`).
    A rank that recorded no address is waited on (bounded by the caller). Pure.

    A worker pod killed outright never acknowledges; waiting for it held the
    head pod, and so the job's next attempt, for the whole bound (15 s, seen
    in the head's log after a SIGKILLed worker pod)."""
    return {r for r in missing if addresses.get(r) is None or addresses[r] in alive}


def lone_loss(*, terminated_for: float | None, preempting: bool, announced: int | None) -> bool:
    """Whether a worker's SIGTERM is its own pod's loss (stop Ray now) rather
    than the whole job stopping (keep Ray up for the final checkpoint). Pure.

    ``terminated_for``: seconds since this pod's SIGTERM (None: none).
    ``preempting``: the driver wrote `PREEMPTING_KEY` (it got SIGTERM too).
    ``announced``: the driver's exit code, once published.

    A pod deleted alone (a drain, an eviction through the API, a spot notice)
    would otherwise keep its Ray node up for its whole grace period while the
    driver, seeing nothing wrong, trains on; once its Ray node stops, the
    driver sees the node gone and waits for the pod the operator puts in its
    place (docs/ray-driver.md). When the job stops as a whole the driver got
    SIGTERM at the same moment and says so within `LONE_LOSS_SECONDS`; a head
    slower than that costs the final checkpoint (the job resumes from its
    newest commit), never a committed step."""
    if terminated_for is None or preempting or announced is not None:
        return False
    return terminated_for >= LONE_LOSS_SECONDS
