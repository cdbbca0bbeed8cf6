"""The distribution ships every package of the four source roots.

Covers: each directory with an `__init__.py` under a source root is named in
pyproject's package list (or lies under one that is), so a wheel built for the
Docker images contains what the editable install imports.
"""

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_package_is_listed() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    mapping = config["package-dir"]
    found = set()
    for package, directory in mapping.items():
        for init in (ROOT / directory).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / directory)
            parts = [p for p in relative.parts if p]
            found.add(".".join([package, *parts]))
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"
