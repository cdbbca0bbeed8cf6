"""Helpers for the chart's tests: the pinned helm, kubectl, rendering (test code, not tests)."""

import os
import pathlib
import subprocess
from typing import Any

import yaml

from cairn.devcluster import build

REPO = pathlib.Path(__file__).resolve().parents[3]
CHART = REPO / "charts" / "cairn"
KUBECTL = build.KUBERNETES.bin_dir / "kubectl"
KUBE_VERSION = "1.34.3"
USER_ROLES = ("cairn-trainingjob-viewer", "cairn-trainingjob-editor")
"""ClusterRoles for people (templates/user-roles.yaml), not the operator's own."""


def install_helm() -> pathlib.Path:
    """The pinned helm (scripts/install-helm: cached; builds from Go the first time, ~3.5 min)."""
    result = subprocess.run(
        [str(REPO / "scripts" / "install-helm")],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if result.returncode != 0:
        raise AssertionError(f"scripts/install-helm failed: {result.stderr[-2000:]}")
    return pathlib.Path(result.stdout.strip().splitlines()[-1])


def run(
    argv: list[str],
    *,
    kubeconfig: pathlib.Path | None = None,
    stdin: str | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if kubeconfig is not None:
        env["KUBECONFIG"] = str(kubeconfig)
    env["HELM_CACHE_HOME"] = env.get("HELM_CACHE_HOME", "/tmp/cairn-helm/cache")
    env["HELM_CONFIG_HOME"] = env.get("HELM_CONFIG_HOME", "/tmp/cairn-helm/config")
    env["HELM_DATA_HOME"] = env.get("HELM_DATA_HOME", "/tmp/cairn-helm/data")
    return subprocess.run(
        argv, input=stdin, capture_output=True, text=True, env=env, timeout=timeout, check=False
    )


def ok(result: subprocess.CompletedProcess[str]) -> str:
    if result.returncode != 0:
        raise AssertionError(
            f"{' '.join(result.args)} failed ({result.returncode}):\n{result.stderr}"
        )
    return result.stdout


def set_args(values: dict[str, str]) -> list[str]:
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


def template(
    helm: pathlib.Path, *, namespace: str, values: dict[str, str], release: str = "cairn"
) -> str:
    return ok(
        run(
            [
                str(helm),
                "template",
                release,
                str(CHART),
                "--namespace",
                namespace,
                "--kube-version",
                KUBE_VERSION,
                *set_args(values),
            ]
        )
    )


def documents(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def kubectl(kubeconfig: pathlib.Path, *args: str, stdin: str | None = None) -> str:
    return ok(run([str(KUBECTL), *args], kubeconfig=kubeconfig, stdin=stdin))
