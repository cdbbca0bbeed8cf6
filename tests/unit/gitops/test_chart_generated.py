"""The chart's generated files stay equal to their generators.

Covers: ``charts/cairn/templates/crd.yaml`` and
``charts/cairn/files/operator-rbac.yaml`` equal what ``charts/generate.py``
produces now (from ``cairn.api.crdgen`` and ``cairn.operator.core.rbac``); the
CRD inside the template is byte-for-byte the YAML body of ``crds/`` (so the
chart and ``kubectl apply -f crds/`` install the same CRD); ``--check``
exits 1 on drift; the operator's rules grant nothing on Secrets or Nodes and
no ``*``; and docs/gitops.md quotes the shipped health.lua verbatim. The
rendered chart is compared with ``crdgen.crd()`` through real Helm in
tests/integration/chart.
"""

import importlib.util
import pathlib
import textwrap
from types import ModuleType

import pytest

from cairn.api import crdgen
from cairn.operator.core import rbac

REPO = pathlib.Path(__file__).resolve().parents[3]


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("chart_generate", REPO / "charts" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = _generator()


def test_committed_files_match_the_generator() -> None:
    stale = [
        str(path.relative_to(REPO))
        for path, text in generate.outputs().items()
        if path.read_text() != text
    ]
    assert stale == [], "run: python charts/generate.py"


def test_check_mode_reports_drift(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stale = tmp_path / "operator-rbac.yaml"
    stale.write_text("namespaced: []\n")
    monkeypatch.setattr(generate, "outputs", lambda: {stale: generate.rbac_file()})
    assert generate.main(["--check"]) == 1
    assert "operator-rbac.yaml is out of date" in capsys.readouterr().err
    assert stale.read_text() == "namespaced: []\n"
    assert generate.main([]) == 0
    assert generate.main(["--check"]) == 0


def test_crd_body_equals_crds_dir() -> None:
    template = (REPO / "charts" / "cairn" / "templates" / "crd.yaml").read_text()
    spliced = template.replace(generate.CRD_METADATA, "")
    body = spliced.removeprefix(generate.CRD_HEADER).removesuffix(generate.CRD_FOOTER)
    assert crdgen.HEADER + body == crdgen.render()
    assert crdgen.render() == (REPO / "crds" / "cairn.dev_trainingjobs.yaml").read_text()


def test_rules_are_least_privilege() -> None:
    for rule in (*rbac.NAMESPACED_RULES, *rbac.CLUSTER_RULES):
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
        assert not {"nodes", "pods/exec", "configmaps"} & set(rule["resources"])
        if "secrets" in rule["resources"]:
            # The S3 credentials Secret a job names and the job's manifest-key
            # Secret: read by name; the latter created once. No list/watch/update.
            assert (rule["resources"], rule["verbs"]) == (["secrets"], ["get", "create"])
            assert rule in rbac.NAMESPACED_RULES
        if rule["resources"] == ["trainingjobs/finalizers"]:
            # OwnerReferencesPermissionEnforcement: children carry blockOwnerDeletion.
            assert rule["verbs"] == ["update"]
            continue
        assert not {"escalate", "bind", "impersonate", "update", "deletecollection"} & set(
            rule["verbs"]
        )
    for rule in rbac.CLUSTER_RULES:
        if rule["apiGroups"] == ["admissionregistration.k8s.io"]:
            # policycheck: the status policy and its binding, read by name only.
            assert rule["verbs"] == ["get"]
            continue
        assert set(rule["verbs"]) <= {"list", "watch"}


def test_gitops_doc_quotes_health_lua() -> None:
    lua = (REPO / "charts" / "cairn" / "files" / "health.lua").read_text()
    doc = (REPO / "docs" / "gitops.md").read_text()
    assert textwrap.indent(lua, "    ").replace("    \n", "\n") in doc
