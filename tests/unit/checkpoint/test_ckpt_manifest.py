"""Manifest schema, step-folder names and path safety (cairn.api.manifest).

Covers: step names sort and parse; manifests with `..`, absolute paths,
backslashes or NUL are refused at parse time; duplicates and future format
versions are refused; files of a rank; round trip through JSON.
"""

from __future__ import annotations

import json

import pydantic
import pytest

from cairn.api import manifest


def entry(path: str, rank: int = 0) -> dict[str, object]:
    return {"path": path, "size": 3, "crc32c": "0000abcd", "rank": rank}


def manifest_json(*paths: str, **overrides: object) -> str:
    doc: dict[str, object] = {
        "step": 7,
        "world_size": 2,
        "attempt": 0,
        "created_at": 1.0,
        "files": [entry(p, i % 2) for i, p in enumerate(paths)],
    }
    doc.update(overrides)
    return json.dumps(doc)


@pytest.mark.parametrize(
    ("step", "name"), [(0, "step-000000000"), (123, "step-000000123"), (10**10, "step-10000000000")]
)
def test_step_names_round_trip(step: int, name: str) -> None:
    assert manifest.step_dir_name(step) == name
    assert manifest.parse_step_dir_name(name) == step


@pytest.mark.parametrize("name", ["step-12", "step-00000001x", "foo", "step-000000001.tmp", ""])
def test_other_names_are_not_steps(name: str) -> None:
    assert manifest.parse_step_dir_name(name) is None


def test_step_names_sort_numerically() -> None:
    names = [manifest.step_dir_name(s) for s in (100, 9, 20)]
    assert sorted(names) == [manifest.step_dir_name(s) for s in (9, 20, 100)]


@pytest.mark.parametrize(
    "path",
    [
        "../escape",
        "a/../../b",
        "/etc/passwd",
        "C:/x",
        "a\\b",
        "a//b",
        "./a",
        "",
        "a\x00b",
    ],
)
def test_unsafe_paths_are_refused(path: str) -> None:
    with pytest.raises(pydantic.ValidationError):
        manifest.parse_manifest(manifest_json("__0_0.distcp", path))
    with pytest.raises(manifest.UnsafePathError):
        manifest.check_relative_path(path)


def test_valid_manifest_round_trips() -> None:
    parsed = manifest.parse_manifest(manifest_json("__0_0.distcp", ".metadata", "sub/__1_0.distcp"))
    assert parsed.total_bytes == 9
    assert [e.path for e in parsed.files_of_rank(1)] == [".metadata"]
    assert manifest.parse_manifest(manifest.dump_manifest(parsed)) == parsed


@pytest.mark.parametrize(
    "doc",
    [
        manifest_json("a", "a"),
        manifest_json("manifest.json"),
        manifest_json("a", format_version=99),
        manifest_json("a", step=-1),
        manifest_json("a", unknown=1),
    ],
    ids=["duplicate", "lists-itself", "future-version", "negative-step", "unknown-field"],
)
def test_invalid_manifests_are_refused(doc: str) -> None:
    with pytest.raises(pydantic.ValidationError):
        manifest.parse_manifest(doc)


def test_checksum_must_be_hex() -> None:
    bad = manifest_json("a").replace("0000abcd", "XYZ")
    with pytest.raises(pydantic.ValidationError):
        manifest.parse_manifest(bad)
