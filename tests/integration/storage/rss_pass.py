"""One operator S3 pass in a process of its own, reporting its memory (``test_tenant_caps``).

``python -m tests.integration.storage.rss_pass KUBECONFIG NAMESPACE NAME [MAX_BYTES]``
runs ``s3pass.storage_pass`` for the job as the operator does (its Secret
read, the prefix claimed, listed, judged, the status patched) and prints one
JSON line: the process's RSS just before the pass, its peak RSS after
(``VmRSS``/``VmHWM`` from /proc/self/status, KiB), and the pass's verdicts.
The S3 client is built (and one LIST sent) before the baseline: the
operator's first pass pays that once per process, not per manifest.
``MAX_BYTES`` replaces ``manifest_max_bytes`` (a comparison run for
``bench/``: the memory a larger cap costs).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
import sys

from kubernetes import config

from cairn.api import trainingjob
from cairn.operator import kubeapi, s3observe, s3pass
from cairn.operator.core import jobobserve, tunables


def status_kib(field: str) -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise LookupError(field)


def main(argv: list[str]) -> int:
    kubeconfig, namespace, name = argv[:3]
    api = kubeapi.KubeApi.of(config.new_client_from_config(config_file=kubeconfig))
    raw = api.custom.get_namespaced_custom_object(
        trainingjob.GROUP, trainingjob.VERSION, namespace, trainingjob.PLURAL, name
    )
    job = jobobserve.parse_job(raw)
    assert isinstance(job, trainingjob.TrainingJob)
    bounds = tunables.DEFAULT.s3
    if len(argv) > 3:
        bounds = dataclasses.replace(bounds, manifest_max_bytes=int(argv[3]))
    # What any first pass costs once per process (the S3 client, its service
    # model, a LIST's parsers) is paid before the baseline: the operator has it.
    upload = job.spec.checkpoint.upload
    assert upload is not None
    s3 = s3observe.client_for(api, namespace, upload, job_uid=job.metadata.uid)
    bucket, _ = upload.uri.removeprefix("s3://").split("/", 1)
    s3.list_objects_v2(Bucket=bucket, Prefix="warm-up/", MaxKeys=1)
    before = status_kib("VmRSS")
    result = s3pass.storage_pass(
        api=api,
        raw=raw,
        job=job,
        caches=s3observe.Caches(),
        now=lambda: datetime.datetime.now(datetime.UTC),
        bounds=bounds,
    )
    verdicts = {
        v.step: {"verified": v.verified, "reason": v.reason}
        for v in (result.plan.verdicts if result.plan else ())
    }
    print(
        json.dumps(
            {
                "rss_before_kib": before,
                "peak_after_kib": status_kib("VmHWM"),
                "error": result.error,
                "verdicts": verdicts,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
