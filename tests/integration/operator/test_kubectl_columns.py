"""`kubectl get tj` shows a job's progress with real values.

Covers: for a job that restarted once (rank 1 exits 3 in attempt 1) and whose
rank-0 writer reported a step, a committed and an uploaded checkpoint (a
status patch made with the job's own ServiceAccount token, as the writer
does), the real kubectl binary prints the columns NAME, PHASE, STEP,
COMMITTED, UPLOADED, RESTARTS, LAST-CKPT, AGE with those values, and
`-o wide` adds ATTEMPT, NODES, RESUMED-FROM, VERIFIED (the operator's S3
verification; empty here) and the Ready message.
"""

import datetime
import re
import subprocess

import pytest
from kubernetes import client

from cairn.devcluster import build
from tests.integration.devcluster import kube_helpers as kh
from tests.integration.operator.conftest import GROUP, PLURAL, VERSION, WAIT, Kube, job_body

pytestmark = pytest.mark.cluster

COLUMNS = ["NAME", "PHASE", "STEP", "COMMITTED", "UPLOADED", "RESTARTS", "LAST-CKPT", "AGE"]
WIDE = [*COLUMNS, "ATTEMPT", "NODES", "RESUMED-FROM", "VERIFIED", "MESSAGE"]
FAIL_FIRST_ATTEMPT = """
import os, sys, time
if os.environ['CAIRN_ATTEMPT'] == '1' and os.environ['CAIRN_NODE_RANK'] == '1':
    time.sleep(0.5)
    sys.exit(3)
time.sleep(600)
"""
AGE = re.compile(r"^\d+[smhd](\d+[smh])?$")


def kubectl(kube: Kube, *args: str) -> str:
    binary = build.KUBERNETES.bin_dir / "kubectl"
    result = subprocess.run(
        [str(binary), f"--kubeconfig={kube.handle.kubeconfig}", "-n", kube.namespace, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def table(text: str) -> list[dict[str, str]]:
    """kubectl's aligned table as rows of {header: value}, sliced at the header's columns."""
    header, *lines = text.rstrip("\n").split("\n")
    names = header.split()
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    rows = []
    for line in lines:
        cells = [
            line[start : starts[i + 1] if i + 1 < len(starts) else None].strip()
            for i, start in enumerate(starts)
        ]
        rows.append(dict(zip(names, cells, strict=True)))
    return rows


def _iso(when: datetime.datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def test_get_tj_columns(kube: Kube) -> None:
    kube.create(job_body("cols", script=FAIL_FIRST_ATTEMPT))
    kube.wait_phase("cols", "Running", attempt=2)

    now = datetime.datetime.now(datetime.UTC)
    writer = client.CustomObjectsApi(kube.as_service_account("cols-trainer", pod="cols-a2-n0"))
    report = {
        "status": {
            "step": 12,
            "checkpoints": {
                "lastCommitted": {"step": 10, "time": _iso(now - datetime.timedelta(minutes=3))},
                "lastUploaded": {"step": 5, "uri": "s3://cairn-test/cols/step-5"},
                "resumedFrom": {"step": 5, "attempt": 2, "source": "remote"},
            },
        }
    }

    def patched() -> bool:
        try:
            writer.patch_namespaced_custom_object_status(
                GROUP, VERSION, kube.namespace, PLURAL, "cols", report, field_manager="writer"
            )
        except client.ApiException as exc:  # the RoleBinding may not be in RBAC's cache yet
            if exc.status == 403:
                return False
            raise
        return True

    kh.wait_for(patched, timeout=WAIT, what="the writer's status patch")

    (row,) = table(kubectl(kube, "get", "tj"))
    assert list(row) == COLUMNS
    assert {k: row[k] for k in COLUMNS[:6]} == {
        "NAME": "cols",
        "PHASE": "Running",
        "STEP": "12",
        "COMMITTED": "10",
        "UPLOADED": "5",
        "RESTARTS": "1",
    }
    assert re.fullmatch(r"3m(\d+s)?", row["LAST-CKPT"]), row
    assert AGE.match(row["AGE"]), row

    (wide,) = table(kubectl(kube, "get", "trainingjobs", "-o", "wide"))
    assert list(wide) == WIDE
    assert {k: wide[k] for k in WIDE[:6]} == {k: row[k] for k in COLUMNS[:6]}
    assert {k: wide[k] for k in WIDE[8:]} == {
        "ATTEMPT": "2",
        "NODES": "2",
        "RESUMED-FROM": "5",
        # The operator's verified step (status.storage.verifiedStep); this job has
        # no upload, so nothing to verify (the server leaves the cell empty). The
        # writer's lastUploaded.verified is not it.
        "VERIFIED": "",
        "MESSAGE": "attempt 2: all 2 pod(s) running",
    }
