"""The Dockerfile's build context is complete, without a Docker engine.

Covers: both targets exist; every COPY source exists in the repository and is
not excluded by .dockerignore; the wheel stage copies every source root of the
product distribution (pyproject's package-dir) and no devcluster, which
.dockerignore also keeps out of the build context; every install goes through
requirements.lock; the base image is pinned to a version; each target runs as
a non-root user; the operator target installs no torch (its extra has none)
and its entrypoint module exists, as does the trainer's launcher (torchrun
ships with torch). tests/images checks the built operator image itself.
"""

import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def _stages() -> dict[str, str]:
    parts = re.split(r"^FROM ", DOCKERFILE, flags=re.MULTILINE)[1:]
    stages = {}
    for part in parts:
        header, _, body = part.partition("\n")
        match = re.search(r"\bAS\s+(\S+)", header, flags=re.IGNORECASE)
        assert match, f"unnamed stage: FROM {header}"
        stages[match.group(1)] = body
    return stages


def test_targets_exist_and_run_unprivileged() -> None:
    stages = _stages()
    for target in ("operator", "trainer"):
        assert target in stages
        assert re.search(r"^USER 65532:65532$", stages[target], flags=re.MULTILINE)


def test_copy_sources_exist_and_are_not_ignored() -> None:
    ignored = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = [
        src
        for line in DOCKERFILE.splitlines()
        if line.startswith("COPY ") and "--from=" not in line
        for src in line.split()[1:-1]
    ]
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), f"COPY source missing: {src}"
        assert not any(src == pattern or src.startswith(pattern + "/") for pattern in ignored)


def test_wheel_stage_copies_every_source_root_and_no_devcluster() -> None:
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    roots = {directory.split("/", 1)[0] for directory in package_dir.values()}
    copied = {
        line.split()[1] for line in _stages()["wheel"].splitlines() if line.startswith("COPY ")
    }
    assert roots <= copied, f"COPY missing in the wheel stage: {sorted(roots - copied)}"
    assert "devcluster" not in DOCKERFILE.replace("the devcluster is not", "")
    assert "devcluster" in (ROOT / ".dockerignore").read_text().split()


def test_every_install_uses_the_lock() -> None:
    installs = [line for line in DOCKERFILE.splitlines() if "pip install" in line]
    assert len(installs) == 3  # uv itself (hashes), then one virtualenv per target
    uv, *targets = installs
    assert "--require-hashes" in uv and "scripts/uv.txt" in uv
    assert all("-c requirements.lock" in line for line in targets)


def test_base_image_pinned() -> None:
    match = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", DOCKERFILE, flags=re.MULTILINE)
    assert match
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", match.group(1))


def test_operator_extra_has_no_torch_and_entrypoints_exist() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert not any(req.startswith(("torch", "ray")) for req in extras["operator"])
    assert any(req.startswith("torch") for req in extras["trainer"])
    assert '"-m", "cairn.operator"' in _stages()["operator"]
    assert (ROOT / "operator/cairn/operator/__main__.py").exists()
