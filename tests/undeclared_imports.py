"""Finds third-party modules the repository imports that no declared dependency provides.

A package installed by hand into a long-lived virtualenv makes every local run
green while a fresh machine fails; this check finds that case first. It reads
the requirements of every pyproject.toml in the repository (all extras, the
build requirements too), follows them through the installed distributions'
own requirements (with the extras asked for), maps each imported top-level
module to the distributions that provide it, and reports the imports that
nothing in that closure provides. `tests/unit/test_packaging.py` runs it on
the repository; from the repository root it also runs alone:

    ~/.cache/cairn/venv/bin/python -m tests.undeclared_imports

Exit status 1 and one line per module when something is undeclared.
"""

import ast
import collections.abc
import dataclasses
import importlib.metadata
import pathlib
import re
import sys
import tomllib

FIRST_PARTY = frozenset({"cairn", "tests", "__future__"})
SKIP_DIRS = frozenset(
    {".git", ".venv", "venv", "node_modules", "build", "dist", ".state", "gomod", "__pycache__"}
)
_EXTRA_MARKER = re.compile(r"extra\s*==\s*['\"]([^'\"]+)['\"]")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Finding:
    """One imported module that no declared dependency provides."""

    module: str
    imported_by: str
    providers: tuple[str, ...]

    def __str__(self) -> str:
        if not self.providers:
            return f"{self.module}: not installed at all (imported by {self.imported_by})"
        return (
            f"{self.module}: provided by {', '.join(self.providers)}, which no pyproject.toml "
            f"declares (imported by {self.imported_by})"
        )


def normalize(name: str) -> str:
    """PEP 503 name normalization. Pure."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_requirement(text: str) -> tuple[str, frozenset[str]]:
    """Name and extras of one requirement string (markers ignored). Pure."""
    head = text.split(";", 1)[0].strip()
    name = re.split(r"[\s\[<>=!~(@]", head, maxsplit=1)[0]
    extras = re.search(r"\[([^\]]*)\]", head)
    wanted = frozenset(e.strip() for e in extras.group(1).split(",")) if extras else frozenset()
    return normalize(name), wanted - {""}


def declared_requirements(pyprojects: collections.abc.Iterable[pathlib.Path]) -> list[str]:
    """Every requirement string the given pyproject files declare, all extras included."""
    found: list[str] = []
    for path in pyprojects:
        config = tomllib.loads(path.read_text())
        project = config.get("project", {})
        found += project.get("dependencies", [])
        for extra in project.get("optional-dependencies", {}).values():
            found += extra
        found += config.get("build-system", {}).get("requires", [])
    return found


def dependency_closure(requirements: collections.abc.Iterable[str]) -> set[str]:
    """Normalized names of the requirements and, through the installed metadata, of
    everything they require (following the extras that were asked for)."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [parse_requirement(r) for r in requirements]
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for requirement in requires:
            marker = _EXTRA_MARKER.search(requirement)
            if marker is None or marker.group(1) in extras:
                todo.append(parse_requirement(requirement))
    return {name for name, _ in seen}


def imported_modules(source: str) -> set[str]:
    """Top-level names of the absolute imports in one module's source. Pure."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def python_files(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(
        path for path in root.rglob("*.py") if not SKIP_DIRS & set(path.relative_to(root).parts)
    )


def _is_local(module: str, *, root: pathlib.Path, importer: pathlib.Path) -> bool:
    """A sibling module or a top-level one of the repository (bench scripts import
    each other by file name)."""
    return any(
        (folder / module).is_dir() or (folder / f"{module}.py").is_file()
        for folder in (root, importer.parent)
    )


def find_undeclared(root: pathlib.Path) -> list[Finding]:
    """The check over one repository, against the running interpreter's installed
    distributions."""
    pyprojects = [p for p in root.rglob("pyproject.toml") if not SKIP_DIRS & set(p.parts)]
    own = {normalize(tomllib.loads(p.read_text())["project"]["name"]) for p in pyprojects}
    closure = dependency_closure(
        r for r in declared_requirements(pyprojects) if parse_requirement(r)[0] not in own
    )
    providers = {
        module: {normalize(d) for d in dists}
        for module, dists in importlib.metadata.packages_distributions().items()
    }
    first_importer: dict[str, pathlib.Path] = {}
    for path in python_files(root):
        for module in sorted(imported_modules(path.read_text())):
            if module in sys.stdlib_module_names or module in FIRST_PARTY:
                continue
            if _is_local(module, root=root, importer=path):
                continue
            first_importer.setdefault(module, path)
    findings = []
    for module, path in sorted(first_importer.items()):
        dists = providers.get(module, set())
        if not dists & closure:
            findings.append(
                Finding(
                    module=module,
                    imported_by=str(path.relative_to(root)),
                    providers=tuple(sorted(dists)),
                )
            )
    return findings


def main() -> int:
    findings = find_undeclared(pathlib.Path.cwd())
    for finding in findings:
        print(finding)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
