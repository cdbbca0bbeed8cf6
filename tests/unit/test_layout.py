"""The operator's layout as docs/architecture.md draws it, checked against the tree.

Covers: the layer picture at the top of docs/architecture.md names every
module of ``operator/cairn/operator`` exactly once and nothing else; no
module imports a module of a higher layer (function-local imports count);
every module in ``core/`` imports only the standard library, pydantic,
yaml, ``cairn.api`` and ``core`` itself (so never kopf, kubernetes, boto3);
the import contract forbids ``core`` every operator module outside it, so a
new IO module cannot slip past ``lint-imports``.
"""

import ast
import configparser
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "operator" / "cairn" / "operator"
PAGE = ROOT / "docs" / "architecture.md"
CORE_MAY_IMPORT = {"pydantic", "yaml"}


def _modules() -> dict[str, pathlib.Path]:
    """Module name relative to ``cairn.operator`` (``core.jobplan``) -> file."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            continue
        found[".".join(parts)] = path
    return found


def _layers() -> list[tuple[str, set[str]]]:
    """The picture's layers, top first: (layer, module names)."""
    text = PAGE.read_text()
    match = re.search(r"<!-- layers:begin -->\n```text\n(.*?)```\n<!-- layers:end -->", text, re.S)
    assert match, "docs/architecture.md lost its layer picture"
    assert text.index("<!-- layers:begin -->") < text.index("\n## "), "the picture opens the page"
    layers: list[tuple[str, set[str]]] = []
    for line in match.group(1).splitlines()[2:]:
        if not line.strip() or line.lstrip().startswith("─"):
            continue
        name, cells = line[:11].strip(), line[11:61].split()
        if name:
            layers.append((name, set()))
        layers[-1][1].update(cells)
    return layers


def _imports(path: pathlib.Path) -> set[str]:
    """Every module this file imports, anywhere in it (absolute names)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def _operator_imports(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    prefix = "cairn.operator."
    return {n[len(prefix) :] for n in _imports(path) if n.startswith(prefix)} & set(modules)


def test_the_picture_names_every_module_once() -> None:
    listed: list[str] = [m for _, names in _layers() for m in names if m != "cairn.api"]
    assert sorted(listed) == sorted(set(listed)), "a module in two layers"
    assert set(listed) == set(_modules()), (
        f"missing from the picture: {sorted(set(_modules()) - set(listed))}; "
        f"not in the tree: {sorted(set(listed) - set(_modules()))}"
    )


def test_no_module_imports_a_higher_layer() -> None:
    modules = _modules()
    rank = {m: i for i, (_, names) in enumerate(_layers()) for m in names}
    upward = [
        f"{name} ({rank[name]}) imports {used} ({rank[used]})"
        for name, path in modules.items()
        for used in _operator_imports(path, modules)
        if rank[used] < rank[name]
    ]
    assert not upward


@pytest.mark.parametrize("name", sorted(m for m in _modules() if m.startswith("core.")))
def test_core_imports_nothing_that_does_io(name: str) -> None:
    allowed_cairn = ("cairn.api", "cairn.operator.core")
    bad = set()
    for used in _imports(_modules()[name]):
        root = used.split(".")[0]
        if root == "cairn":
            if not used.startswith(allowed_cairn) and used != "cairn.operator":
                bad.add(used)
        elif root not in sys.stdlib_module_names and root not in CORE_MAY_IMPORT:
            bad.add(used)
    assert not bad, f"cairn.operator.{name} imports {sorted(bad)}"


def test_the_contract_forbids_core_every_module_outside_it() -> None:
    config = configparser.ConfigParser()
    config.read(ROOT / ".importlinter")
    contract = config["importlinter:contract:pure-operator-core"]
    assert contract["source_modules"].split() == ["cairn.operator.core"]
    forbidden = {
        line.strip()
        for line in contract["forbidden_modules"].splitlines()
        if line.strip() and not line.strip().startswith("#")
    }
    assert {"kopf", "kubernetes", "boto3", "botocore"} <= forbidden
    outside = {f"cairn.operator.{m}" for m in _modules() if not m.startswith("core.")}
    assert outside - forbidden == set(), "add the new module to the contract"
