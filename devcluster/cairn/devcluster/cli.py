"""The `devcluster` command: `up [--with-kueue]`, `down`, `status`, `env`.

Prints one line per fact, and for a `DevclusterError` one line saying what to
do (exit code 2) instead of a traceback.
"""

import argparse
import json
import os
import sys

from cairn.devcluster import build, cluster, errors, kueue

# Set to 1 to make every `devcluster up` start Kueue too (same as --with-kueue).
WITH_KUEUE_ENV = "CAIRN_DEVCLUSTER_KUEUE"


def with_kueue(*, flag: bool, environ: dict[str, str]) -> bool:
    """Pure: whether `up` starts Kueue, from the flag or the environment."""
    return flag or environ.get(WITH_KUEUE_ENV, "").strip().lower() in ("1", "true", "yes")


def _print_kueue(report: kueue.KueueReport) -> None:
    if report.already_running:
        print(f"devcluster: Kueue {build.KUEUE_VERSION} already running")
        return
    built = f"built in {report.build_seconds:.0f}s" if report.build_seconds else "cached"
    print(
        f"devcluster: Kueue {build.KUEUE_VERSION} ready in {report.ready_seconds:.1f}s "
        f"({built}; webhook https://127.0.0.1:{kueue.KueuePorts().webhook})"
    )


def _up(target: cluster.Cluster, *, start_kueue: bool) -> int:
    report = cluster.up(target, with_kueue=start_kueue)
    if report.kueue_report is not None:
        _print_kueue(report.kueue_report)
    if report.already_running:
        print(f"devcluster: already up at {target.server}")
        return 0
    built = ", ".join(f"{k} {v:.0f}s" for k, v in report.build_seconds.items() if v) or "cached"
    print(
        f"devcluster: up at {target.server} (Kubernetes {build.KUBERNETES_VERSION}, "
        f"etcd {build.ETCD_VERSION}; build: {built}; ready in {report.ready_seconds:.1f}s)"
    )
    print(f'devcluster: S3 at {target.s3_endpoint}; run `eval "$(devcluster env)"` for clients')
    return 0


def _build(target: cluster.Cluster) -> int:
    seconds = build.build_all(log_dir=target.state.logs)
    for bundle in build.BUNDLES:
        took = f"built in {seconds[bundle.name]:.0f}s" if seconds[bundle.name] else "cached"
        print(f"devcluster: {bundle.name} {bundle.version} ({took}) in {bundle.bin_dir}")
    return 0


def _status(target: cluster.Cluster, *, as_json: bool) -> int:
    running = cluster.running_components(target)
    optional = cluster.optional_components(target)
    if as_json:
        print(json.dumps({"server": target.server, "components": running, "optional": optional}))
    else:
        for name, alive in running.items():
            print(f"{name:24} {'running' if alive else 'stopped'}")
        for name, alive in optional.items():
            print(f"{name:24} {'running' if alive else 'stopped'} (on demand)")
    return 0 if all(running.values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="devcluster", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build (or find cached) etcd, Kubernetes and Kueue binaries")
    up = sub.add_parser("up", help="build (if needed) and start the local cluster")
    up.add_argument(
        "--with-kueue",
        action="store_true",
        help=f"also start Kueue {build.KUEUE_VERSION} (or set {WITH_KUEUE_ENV}=1)",
    )
    down = sub.add_parser("down", help="stop every process the cluster started")
    down.add_argument("--purge", action="store_true", help="also delete the state dir")
    status = sub.add_parser("status", help="which components run (exit 1 if not all)")
    status.add_argument("--json", action="store_true")
    sub.add_parser("env", help="shell exports: KUBECONFIG, PATH (kubectl), S3 credentials")
    args = parser.parse_args(argv)
    target = cluster.Cluster.default()
    try:
        if args.command == "build":
            return _build(target)
        if args.command == "up":
            return _up(
                target, start_kueue=with_kueue(flag=args.with_kueue, environ=dict(os.environ))
            )
        if args.command == "down":
            cluster.down(target, purge=args.purge)
            print("devcluster: down")
            return 0
        if args.command == "status":
            return _status(target, as_json=args.json)
        print("\n".join(cluster.env_lines(target)))
        return 0
    except errors.DevclusterError as exc:
        print(f"devcluster: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "devcluster: interrupted; run `devcluster down` to stop what started", file=sys.stderr
        )
        return 130
