"""Packaging: the distribution, the lock and the declared dependencies.

Covers: each directory with an `__init__.py` under a source root is named in
pyproject's package list (or lies under one that is), for the product and for
the devcluster's own distribution, so a wheel built for the images contains
what the editable install imports; the product lists no devcluster package and
only its dev extra requires the devcluster; requirements.lock pins every
declared dependency with hashes; the virtualenv is exactly the lock (nothing
installed by hand); the repository imports no module that its declared
dependencies do not provide, and that check (tests/undeclared_imports.py)
reports a planted import, a module nothing provides, and follows only the
extras asked for, while stdlib, first-party, relative and sibling imports pass.
"""

import importlib.metadata
import pathlib
import re
import tomllib

import pytest

from tests import undeclared_imports

ROOT = pathlib.Path(__file__).resolve().parents[2]


PYPROJECTS = {
    "cairn-training": ROOT / "pyproject.toml",
    "cairn-devcluster": ROOT / "devcluster/pyproject.toml",
}


@pytest.mark.parametrize("distribution", sorted(PYPROJECTS))
def test_every_package_is_listed(distribution: str) -> None:
    pyproject = PYPROJECTS[distribution]
    config = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    mapping = config["package-dir"]
    found = set()
    for package, directory in mapping.items():
        for init in (pyproject.parent / directory).rglob("__init__.py"):
            relative = init.parent.relative_to(pyproject.parent / directory)
            parts = [p for p in relative.parts if p]
            found.add(".".join([package, *parts]))
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"


def test_product_distribution_has_no_devcluster() -> None:
    """The devcluster is its own distribution, a dependency of the dev extra only."""
    project = tomllib.loads(PYPROJECTS["cairn-training"].read_text())
    packages = project["tool"]["setuptools"]["packages"]
    assert not [p for p in packages if p.startswith("cairn.devcluster")]
    extras = project["project"]["optional-dependencies"]
    users = [name for name, reqs in extras.items() if any("devcluster" in r for r in reqs)]
    assert users == ["dev"]
    assert "devcluster" not in extras


def _locked() -> dict[str, str]:
    """Name -> version of every pin in requirements.lock."""
    pins = re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (ROOT / "requirements.lock").read_text(), re.M)
    return {undeclared_imports.normalize(name): version for name, version in pins}


def test_lock_pins_every_declared_dependency_with_hashes() -> None:
    pyprojects = list(PYPROJECTS.values())
    own = set(PYPROJECTS)
    declared = {
        undeclared_imports.parse_requirement(r)[0]
        for r in undeclared_imports.declared_requirements(pyprojects)
    }
    runtime = declared - own - {"setuptools", "wheel"}  # build requirements are not installed
    missing = runtime - set(_locked())
    assert not missing, f"not in requirements.lock (run scripts/lock): {sorted(missing)}"
    entries = re.split(r"^(?=\S)", (ROOT / "requirements.lock").read_text(), flags=re.M)
    unhashed = [e.split()[0] for e in entries if "==" in e.split("\n")[0] and "--hash=" not in e]
    assert not unhashed


def test_virtualenv_is_exactly_the_lock() -> None:
    """scripts/bootstrap syncs the venv to the lock: a version that differs, or a
    package installed by hand, means the venv is not what CI runs."""
    installed = {
        undeclared_imports.normalize(d.metadata["Name"]): d.version
        for d in importlib.metadata.distributions()
    }
    locked = _locked()
    own = set(PYPROJECTS)
    differ = {n: (v, installed.get(n)) for n, v in locked.items() if installed.get(n) != v}
    extra = sorted(set(installed) - set(locked) - own)
    assert not differ, f"locked vs installed (run scripts/bootstrap): {differ}"
    assert not extra, f"installed but not locked (run scripts/bootstrap): {extra}"


def test_repository_imports_only_declared_modules() -> None:
    findings = undeclared_imports.find_undeclared(ROOT)
    assert not findings, "\n".join(map(str, findings))


def _repo(tmp_path: pathlib.Path, *, requires: list[str], source: str) -> pathlib.Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "pyproject.toml").write_text(
        f'[project]\nname = "planted"\nversion = "0"\ndependencies = {requires!r}\n'.replace(
            "'", '"'
        )
    )
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "sibling.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text(source)
    return tmp_path


def test_planted_import_of_an_installed_but_undeclared_package_is_reported(
    tmp_path: pathlib.Path,
) -> None:
    repo = _repo(tmp_path, requires=["pyyaml"], source="import yaml\nimport lupa\n")
    findings = undeclared_imports.find_undeclared(repo)
    assert [(f.module, f.imported_by, f.providers) for f in findings] == [
        ("lupa", "pkg/mod.py", ("lupa",))
    ]


def test_import_of_a_module_nothing_provides_is_reported(tmp_path: pathlib.Path) -> None:
    repo = _repo(tmp_path, requires=[], source="import no_such_module_anywhere\n")
    (finding,) = undeclared_imports.find_undeclared(repo)
    assert "not installed at all" in str(finding)


def test_stdlib_first_party_relative_and_sibling_imports_are_not_reported(
    tmp_path: pathlib.Path,
) -> None:
    source = "import json\nimport cairn.api\nfrom . import sibling\nimport sibling\nimport pkg\n"
    repo = _repo(tmp_path, requires=[], source=source)
    assert undeclared_imports.find_undeclared(repo) == []


def test_transitive_requirements_follow_only_the_extras_asked_for(tmp_path: pathlib.Path) -> None:
    # boto3-stubs provides mypy_boto3_s3 only through its `s3` extra.
    source = "import mypy_boto3_s3\nimport botocore\n"
    with_extra = _repo(tmp_path / "a", requires=["boto3-stubs[s3]", "boto3"], source=source)
    without = _repo(tmp_path / "b", requires=["boto3-stubs", "boto3"], source=source)
    assert undeclared_imports.find_undeclared(with_extra) == []
    assert [f.module for f in undeclared_imports.find_undeclared(without)] == ["mypy_boto3_s3"]
