"""`python -m cairn.operator`: run the Cairn operator (kopf) with JSON logs.

The same command the chart's Deployment runs. Watches every namespace by
default (`--namespace` restricts it), serves kopf's liveness endpoint, and
runs standalone (one replica; no kopf peering objects needed).
"""

import argparse
import sys

import kopf

from cairn.operator import handlers  # noqa: F401  (importing registers the handlers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cairn.operator", description=__doc__)
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--all-namespaces", "-A", action="store_true", default=True)
    scope.add_argument("--namespace", "-n", action="append", default=None)
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.JSON)
    kopf.run(
        standalone=True,
        clusterwide=args.namespace is None,
        namespaces=args.namespace or (),
        liveness_endpoint=args.liveness or None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
