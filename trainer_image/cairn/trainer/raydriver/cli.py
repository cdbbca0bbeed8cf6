"""Command line of the Ray driver (the exact form is in docs/ray-driver.md).

    python -m cairn.trainer.raydriver [--nodes N] [--procs-per-node P]
        [--cpus-per-rank C] [--gpus-per-rank G] [--max-inplace-restarts K]
        [--address ADDR] [--no-standby] MODULE:FUNCTION [-- ARGS...]

Defaults come from the pod contract: CAIRN_NNODES, CAIRN_NPROC_PER_NODE,
CAIRN_RAY_MAX_INPLACE_RESTARTS (3), CAIRN_FINAL_CHECKPOINT_GRACE_SECONDS,
RAY_ADDRESS; one GPU per rank when CAIRN_RAY_NUM_GPUS > 0. A malformed
contract or argument exits `exitcodes.CONFIG_ERROR` (78) with the reason in
the termination message.
"""

from __future__ import annotations

import argparse
import logging
import os
import typing

from cairn.api import exitcodes, podenv
from cairn.trainer import termination

log = logging.getLogger("cairn.trainer.raydriver")


def _env_number(env: typing.Mapping[str, str], name: str, default: float | None) -> float | None:
    raw = env.get(name, "")
    if raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number") from None


def parse(argv: list[str], env: typing.Mapping[str, str]) -> typing.Any:
    """The driver `Config` of a command line and the pod env; ValueError when malformed."""
    from cairn.trainer.raydriver import driver

    parser = argparse.ArgumentParser(prog="python -m cairn.trainer.raydriver")
    parser.add_argument("--nodes", type=int, default=None)
    parser.add_argument("--procs-per-node", type=int, default=None)
    parser.add_argument("--cpus-per-rank", type=float, default=1.0)
    parser.add_argument("--gpus-per-rank", type=float, default=None)
    parser.add_argument("--max-inplace-restarts", type=int, default=None)
    parser.add_argument("--address", default=None, help="Ray address (default RAY_ADDRESS)")
    parser.add_argument(
        "--no-standby",
        action="store_true",
        help="start every group's rank actors fresh (no warm standbys)",
    )
    parser.add_argument("target", help="MODULE:FUNCTION, called with the ARGS after --")
    ours, sep, theirs = _split(argv)
    args = parser.parse_args(ours)
    if ":" not in args.target:
        raise ValueError(f"target {args.target!r}: expected MODULE:FUNCTION")
    nodes = args.nodes or int(_env_number(env, podenv.NNODES, 1) or 1)
    procs = args.procs_per_node or int(_env_number(env, podenv.NPROC_PER_NODE, 1) or 1)
    gpus = args.gpus_per_rank
    if gpus is None:
        gpus = 1.0 if (_env_number(env, podenv.RAY_NUM_GPUS, 0) or 0) > 0 else 0.0
    budget = args.max_inplace_restarts
    if budget is None:
        budget = int(_env_number(env, podenv.RAY_MAX_INPLACE_RESTARTS, 3) or 0)
    if nodes < 1 or procs < 1 or budget < 0 or args.cpus_per_rank <= 0 or gpus < 0:
        raise ValueError(
            f"nodes ({nodes}), procs per node ({procs}) must be >= 1, "
            f"max in-place restarts ({budget}) >= 0, cpus per rank > 0, gpus per rank >= 0"
        )
    return driver.Config(
        target=args.target,
        argv=theirs if sep else [],
        nodes=nodes,
        procs_per_node=procs,
        cpus_per_rank=args.cpus_per_rank,
        gpus_per_rank=gpus,
        max_inplace_restarts=budget,
        grace_seconds=_env_number(env, podenv.FINAL_CHECKPOINT_GRACE_SECONDS, None),
        address=args.address,
        standby=not args.no_standby,
    )


def _split(argv: list[str]) -> tuple[list[str], bool, list[str]]:
    """(driver args, whether `--` was given, the function's args)."""
    if "--" in argv:
        index = argv.index("--")
        return argv[:index], True, argv[index + 1 :]
    return argv, False, []


def main(argv: list[str] | None = None) -> int:
    import sys

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        cfg = parse(list(sys.argv[1:] if argv is None else argv), os.environ)
    except ValueError as exc:
        return termination.config_error(exc)
    from cairn.trainer.raydriver import driver
    from cairn.trainer.raydriver import status as status_mod

    reporter = status_mod.from_env(os.environ)
    code = driver.Driver(cfg, reporter=reporter).run()
    if code not in (exitcodes.SUCCESS, exitcodes.PREEMPTED, exitcodes.CONFIG_ERROR):
        log.error("exit %d", code)
    return code
