"""Installing the kubectl plugin as a user does: a wheel of this checkout into an empty venv.

Covers: `pip install 'cairn-training[plugin]'` (uv's pip, from a wheel built
here; dependencies from the package index or uv's cache) into a venv that
holds nothing else, then `kubectl-cairn --help` and `kubectl cairn
checkpoints JOB` through kubectl's plugin discovery against the devcluster,
with the venv's interpreter importing the installed wheel (never the
checkout). Two resolutions: the newest versions the ranges allow (what a
user gets today), and the plugin extra's declared lower bounds pinned
(`kubernetes`, `boto3`, `awscrt` at their `>=` versions), so a bound that is
too low fails here. The plugin extra does not pull torch.
"""

import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

from tests.conftest import DevclusterHandle

from . import conftest

pytestmark = pytest.mark.cluster

UV = conftest.REPO / "scripts" / "uv"
DIST = "cairn-training"
INSTALL_TIMEOUT_S = 240
"""A cold uv cache downloads the lower-bound wheels (~20 MB) once."""


def plugin_lower_bounds() -> dict[str, str]:
    """Name -> the version after `>=` of each requirement of the `plugin` extra."""
    pyproject = tomllib.loads((conftest.REPO / "pyproject.toml").read_text())
    bounds = {}
    for requirement in pyproject["project"]["optional-dependencies"]["plugin"]:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9.]*)(,.*)?", requirement)
        assert match, f"plugin extra requirement without a lower bound: {requirement}"
        bounds[match.group(1).lower()] = match.group(2)
    return bounds


def _release(version: str) -> tuple[int, ...]:
    """`31`, `31.0` and `31.0.0` are one version (PEP 440 pads with zeros)."""
    parts = [int(p) for p in version.split(".")] if version else []
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def _run(argv: list[str], *, env: dict[str, str] | None = None, timeout: float = 60) -> str:
    result = subprocess.run(
        argv, capture_output=True, text=True, env=env, timeout=timeout, check=False
    )
    assert result.returncode == 0, f"{argv[:3]}: {result.stderr[-3000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("wheel")
    _run(
        [str(UV), "build", "--wheel", "--quiet", "--out-dir", str(out), str(conftest.REPO)],
        timeout=INSTALL_TIMEOUT_S,
    )
    (built,) = out.glob("cairn_training-*.whl")
    return built


@pytest.fixture
def job(devcluster: DevclusterHandle, namespace: str) -> tuple[str, str]:
    """(namespace, name) of a job whose status has one committed step."""
    conftest.create_job(devcluster, namespace, "fresh")
    conftest.patch_status(
        devcluster,
        namespace,
        "fresh",
        {"checkpoints": {"lastCommitted": {"step": 20, "time": "2026-11-27T06:00:00Z"}}},
    )
    return namespace, "fresh"


def _fresh_venv(tmp_path: pathlib.Path, wheel: pathlib.Path, pins: dict[str, str]) -> pathlib.Path:
    venv = tmp_path / "venv"
    # uv builds the venv on this interpreter's base installation: none of the
    # test venv's packages are visible in it (the freeze below shows no torch).
    _run([str(UV), "venv", "--quiet", "--python", sys.executable, str(venv)])
    constraints = tmp_path / "lower-bounds.txt"
    constraints.write_text("".join(f"{name}=={version}\n" for name, version in pins.items()))
    _run(
        [
            str(UV),
            "pip",
            "install",
            "--quiet",
            "--python",
            str(venv / "bin" / "python"),
            "--constraint",
            str(constraints),
            f"{DIST}[plugin] @ {wheel.as_uri()}",
        ],
        timeout=INSTALL_TIMEOUT_S,
    )
    return venv


@pytest.mark.parametrize("resolution", ["newest", "lower-bounds"])
def test_plugin_extra_installs_into_an_empty_venv_and_runs(
    devcluster: DevclusterHandle,
    job: tuple[str, str],
    wheel: pathlib.Path,
    tmp_path: pathlib.Path,
    resolution: str,
) -> None:
    pins = plugin_lower_bounds() if resolution == "lower-bounds" else {}
    venv = _fresh_venv(tmp_path, wheel, pins)
    frozen = _run([str(UV), "pip", "freeze", "--python", str(venv / "bin" / "python")])
    installed = dict(line.split("==", 1) for line in frozen.splitlines() if "==" in line)
    installed = {name.lower(): version for name, version in installed.items()}
    assert {name: _release(installed.get(name, "")) for name in pins} == {
        name: _release(version) for name, version in pins.items()
    }
    assert "torch" not in installed  # the plugin extra is light
    env = {
        "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
        "KUBECONFIG": str(devcluster.kubeconfig),
        "HOME": str(tmp_path),
    }
    where = _run(
        [str(venv / "bin" / "python"), "-c", "import cairn.kubectl_plugin as p; print(p.__file__)"],
        env=env,
    )
    assert where.startswith(str(venv)), where  # the wheel, not the checkout
    usage = _run([str(venv / "bin" / "kubectl-cairn"), "--help"], env=env)
    assert "checkpoints" in usage and "resume" in usage
    namespace, name = job
    table = _run([str(conftest.KUBECTL), "cairn", "-n", namespace, "checkpoints", name], env=env)
    header, *rows = table.splitlines()
    assert header.split()[:2] == ["STEP", "STATE"]
    assert [row.split()[:2] for row in rows] == [["20", "committed"]]
