"""`python -m cairn.operator`: run the Cairn operator (kopf) with JSON logs.

The same command the chart's Deployment runs. Watches every namespace by
default (`--namespace` restricts it), serves kopf's liveness endpoint, and
runs kopf standalone (no kopf peering objects). Prometheus metrics are served
on ``--metrics-port`` (default: ``$CAIRN_METRICS_PORT``, which the chart sets
from ``metrics.port``, else 9090; 0 turns them off).

``--leader-elect`` (default: ``$CAIRN_LEADER_ELECT``; the chart turns it on)
makes several replicas safe: the process waits for a Lease
(``cairn.operator.leader``), serving ``/healthz`` while it stands by, and
starts kopf only as the leader; losing the Lease ends the process.
"""

import argparse
import contextlib
import http.server
import logging
import os
import re
import sys
import threading
import urllib.parse
from collections.abc import Iterator

import kopf
from kubernetes import client, config
from kubernetes.config import config_exception

from cairn.operator import (
    handlers,  # noqa: F401  (importing registers the handlers)
    leader,
    metrics,
)

_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
"""An RFC 1123 label: what a namespace name is."""


def _default_metrics_port() -> int:
    value = os.environ.get("CAIRN_METRICS_PORT", "")
    return int(value) if value.isdigit() else metrics.DEFAULT_PORT


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


class _Standby(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(b"standby\n")

    def log_message(self, format: str, *args: object) -> None:
        return  # probes every few seconds: not worth a log line


@contextlib.contextmanager
def _standby_health(liveness: str | None) -> Iterator[None]:
    """Answer the liveness probe while waiting for the Lease (kopf serves it later)."""
    url = urllib.parse.urlsplit(liveness or "")
    if not url.port:
        yield
        return
    server = http.server.ThreadingHTTPServer((url.hostname or "0.0.0.0", url.port), _Standby)
    thread = threading.Thread(target=server.serve_forever, name="cairn-standby", daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


def _lease_settings(args: argparse.Namespace) -> leader.Settings:
    return leader.Settings(
        name=args.lease_name,
        namespace=args.lease_namespace,
        lease_duration=args.lease_duration,
        renew_deadline=args.renew_deadline,
        retry_period=args.retry_period,
    )


def _elect(args: argparse.Namespace) -> leader.Elector:
    """Block until this process leads; then renew in the background."""
    try:
        config.load_incluster_config()
    except config_exception.ConfigException:
        config.load_kube_config()
    settings = _lease_settings(args)
    elector = leader.Elector(leader.LeaseStore(client.ApiClient(), settings), settings)
    with _standby_health(args.liveness):
        elector.campaign()
    elector.keep_leading(on_lost=leader.exit_now)
    return elector


def _env_seconds(name: str, default: float) -> float:
    value = os.environ.get(name, "")
    try:
        return float(value) if value else default
    except ValueError:
        return default


def _add_election_args(parser: argparse.ArgumentParser) -> None:
    """Flags with defaults from the environment the chart sets (``leaderElection.*``)."""
    defaults = leader.Settings(identity="-")
    group = parser.add_argument_group("leader election (several replicas)")
    group.add_argument(
        "--leader-elect",
        action=argparse.BooleanOptionalAction,
        default=_env_flag("CAIRN_LEADER_ELECT"),
        help="run kopf only while holding a coordination.k8s.io Lease",
    )
    group.add_argument("--lease-name", default=os.environ.get("CAIRN_LEASE_NAME") or defaults.name)
    group.add_argument(
        "--lease-namespace", default=os.environ.get("CAIRN_OPERATOR_NAMESPACE") or "default"
    )
    for flag, env, default in (
        ("--lease-duration", "CAIRN_LEASE_DURATION_SECONDS", defaults.lease_duration),
        ("--renew-deadline", "CAIRN_RENEW_DEADLINE_SECONDS", defaults.renew_deadline),
        ("--retry-period", "CAIRN_RETRY_PERIOD_SECONDS", defaults.retry_period),
    ):
        group.add_argument(flag, type=float, default=_env_seconds(env, default))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cairn.operator", description=__doc__)
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--all-namespaces", "-A", action="store_true", default=True)
    scope.add_argument("--namespace", "-n", action="append", default=None)
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=_default_metrics_port(),
        help="port of the Prometheus /metrics endpoint (0: off)",
    )
    parser.add_argument("--verbose", action="store_true")
    _add_election_args(parser)
    args = parser.parse_args(argv)
    patterns = [name for name in args.namespace or () if not _NAMESPACE.fullmatch(name)]
    if patterns:
        # kopf would take globs, but the operator's own pod watch (and the
        # chart's per-namespace Roles) need the names themselves.
        parser.error(f"--namespace takes namespace names, not patterns: {', '.join(patterns)}")
    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.JSON)
    # Never at debug level, even with --verbose: botocore's debug lines carry
    # request headers (the access key id in Authorization) and bodies.
    for quiet in ("botocore", "boto3", "s3transfer", "urllib3"):
        logging.getLogger(quiet).setLevel(logging.WARNING)
    metrics.set_leading(not args.leader_elect)  # a standby: cairn_leader 0, no job series
    metrics.serve(args.metrics_port)  # a standby serves it too (no job series): no scrape errors
    elector = _elect(args) if args.leader_elect else None
    metrics.set_leading(True)
    kopf.run(
        standalone=True,
        clusterwide=args.namespace is None,
        namespaces=args.namespace or (),
        liveness_endpoint=args.liveness or None,
        # handlers.configure builds the operator's runtime from this memo.
        memo=kopf.Memo(watch_namespaces=args.namespace),
    )
    if elector is not None:
        elector.release()  # kopf stopped cleanly (SIGTERM): let a standby take over now
    return 0


if __name__ == "__main__":
    sys.exit(main())
