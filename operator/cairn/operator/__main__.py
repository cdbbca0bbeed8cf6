"""`python -m cairn.operator`: run the Cairn operator (kopf) with JSON logs.

The same command the chart's Deployment runs. Watches every namespace by
default (`--namespace` restricts it), serves kopf's liveness endpoint, and
runs standalone (one replica; no kopf peering objects needed). Prometheus
metrics are served on ``--metrics-port`` (default: ``$CAIRN_METRICS_PORT``,
which the chart sets from ``metrics.port``, else 9090; 0 turns them off).
"""

import argparse
import logging
import os
import sys

import kopf

from cairn.operator import (
    handlers,  # noqa: F401  (importing registers the handlers)
    metrics,
)


def _default_metrics_port() -> int:
    value = os.environ.get("CAIRN_METRICS_PORT", "")
    return int(value) if value.isdigit() else metrics.DEFAULT_PORT


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
    args = parser.parse_args(argv)
    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.JSON)
    # Never at debug level, even with --verbose: botocore's debug lines carry
    # request headers (the access key id in Authorization) and bodies.
    for quiet in ("botocore", "boto3", "s3transfer", "urllib3"):
        logging.getLogger(quiet).setLevel(logging.WARNING)
    metrics.serve(args.metrics_port)
    kopf.run(
        standalone=True,
        clusterwide=args.namespace is None,
        namespaces=args.namespace or (),
        liveness_endpoint=args.liveness or None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
