"""Manifest schema, step-folder names and path safety (cairn.api.manifest).

Covers: step names sort and parse; manifests with `..`, absolute paths,
backslashes or NUL are refused at parse time; duplicates are refused; a newer
major format version is refused with `UnsupportedManifestVersionError`;
unknown fields of the same version are accepted and kept; a manifest of an
older Cairn (no identity, no data_prefix) has its keys directly under the
step; files of a rank; round trip through JSON.
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
        manifest_json("a", step=-1),
        manifest_json("a", data_prefix="a/b"),
    ],
    ids=["duplicate", "lists-itself", "negative-step", "data-prefix-not-one-component"],
)
def test_invalid_manifests_are_refused(doc: str) -> None:
    with pytest.raises(pydantic.ValidationError):
        manifest.parse_manifest(doc)


def test_newer_major_version_is_refused_with_its_own_error() -> None:
    with pytest.raises(manifest.UnsupportedManifestVersionError, match="newer"):
        manifest.parse_manifest(manifest_json("a", format_version=99))


def test_unknown_fields_of_the_same_version_are_accepted_and_kept() -> None:
    parsed = manifest.parse_manifest(manifest_json("a", unknown=1, future_hint={"x": 1}))
    assert parsed.model_extra == {"unknown": 1, "future_hint": {"x": 1}}
    assert b'"unknown"' in manifest.dump_manifest(parsed)


def test_manifest_of_an_older_cairn_has_no_identity_and_flat_keys() -> None:
    parsed = manifest.parse_manifest(manifest_json("__0_0.distcp"))
    assert (parsed.job_uid, parsed.lineage, parsed.parent, parsed.data_prefix) == (
        None,
        None,
        None,
        None,
    )
    assert parsed.data_key("__0_0.distcp") == "__0_0.distcp"
    scoped = parsed.model_copy(update={"data_prefix": "a3-0123abcd"})
    assert scoped.data_key("__0_0.distcp") == "a3-0123abcd/__0_0.distcp"


def test_checksum_must_be_hex() -> None:
    bad = manifest_json("a").replace("0000abcd", "XYZ")
    with pytest.raises(pydantic.ValidationError):
        manifest.parse_manifest(bad)
