"""The committed CRD is exactly what the models generate, and is structural.

Covers: drift between crds/ and ``crdgen.render()``; no constructs a
structural schema forbids (refs, nullable unions, titles); the CEL rules,
printer columns, short name and status subresource the design asks for.
"""

import pathlib
from typing import Any

import yaml

from cairn.api import crdgen

ROOT = pathlib.Path(__file__).resolve().parents[3]
COMMITTED = ROOT / crdgen.DEFAULT_OUTPUT


def test_committed_crd_matches_the_models() -> None:
    assert COMMITTED.read_text() == crdgen.render(), (
        "crds/ is stale: run `python -m cairn.api.crdgen`"
    )


def test_check_mode(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "crd.yaml"
    assert crdgen.main(["--check", "--output", str(target)]) == 1
    assert crdgen.main(["--output", str(target)]) == 0
    assert crdgen.main(["--check", "--output", str(target)]) == 0


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        out.append((path, node))
        for key, value in node.get("properties", {}).items():
            out += _walk(value, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            out += _walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            out += _walk(node["additionalProperties"], f"{path}{{}}")
    return out


def _schema() -> dict[str, Any]:
    doc = yaml.safe_load(COMMITTED.read_text())
    schema: dict[str, Any] = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def test_schema_is_structural() -> None:
    for path, node in _walk(_schema()):
        for banned in ("$ref", "anyOf", "oneOf", "allOf", "title", "const", "nullable"):
            assert banned not in node, (path, banned)
        if not node.get("x-kubernetes-int-or-string"):
            assert "type" in node, path
        assert node.get("default", 0) is not None, path


def _rules() -> list[str]:
    return [
        rule["rule"]
        for _, node in _walk(_schema())
        for rule in node.get("x-kubernetes-validations", [])
    ]


def test_cel_rules_present() -> None:
    rules = " ".join(_rules())
    assert "self >= 2" in rules
    assert ".filter(x, x).size() == 1" in rules
    assert "self.matches('^s3://" in rules
    assert "oldSelf.suspend" in rules and "self.image == oldSelf.image" in rules
    assert "\\" not in rules, "CEL string literals must not carry regex backslashes"


def test_printer_columns_and_names() -> None:
    doc = yaml.safe_load(COMMITTED.read_text())
    version = doc["spec"]["versions"][0]
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert list(columns)[:7] == [
        "Phase",
        "Step",
        "Committed",
        "Uploaded",
        "Restarts",
        "Last-Ckpt",
        "Age",
    ]
    assert columns["Last-Ckpt"]["type"] == "date"
    assert all(columns[n].get("priority") == 1 for n in ("Attempt", "Resumed-From", "Message"))
    assert version["subresources"] == {"status": {}}
    assert doc["spec"]["names"]["shortNames"] == ["tj"]


def test_defaults_are_complete_objects() -> None:
    spec = _schema()["properties"]["spec"]["properties"]
    assert spec["checkpoint"]["default"]["resume"] == {"latest": True}
    assert spec["restartPolicy"]["default"]["maxBackoffSeconds"] == 300


def _undescribed(node: dict[str, Any], path: str) -> list[str]:
    """Fields under `node` whose schema has no description (kubectl explain: <no description>)."""
    missing = []
    for child_path, child in _walk(node, path):
        is_field = child_path != path and not child_path.endswith(("[]", "}"))
        if is_field and not child.get("description"):
            missing.append(child_path)
    return missing


def test_every_spec_and_status_field_is_described() -> None:
    schema = _schema()
    missing = _undescribed(schema["properties"]["spec"], "spec")
    missing += _undescribed(schema["properties"]["status"], "status")
    assert not missing, f"fields without a description: {missing}"
