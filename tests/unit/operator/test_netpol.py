"""The per-job NetworkPolicy (issue 20 item 2), compared as whole objects.

Covers: a torchrun job's policy (selects the job's pods, Ingress only, ingress
from the job's pods on every port, no egress rule, owned by the job with
controller ownerReference and the owner labels, deterministic name); a ray job
without the dashboard gets the same policy; a ray job that asked for the
dashboard also admits the dashboard port (and only it) from anywhere
(``spec.ray`` is refused on a torchrun job); the policy is planned with the
job's other children, before the pods (tests/integration/operator/
test_job_netpol.py checks it on the API server).
"""

from typing import Any

from cairn.operator.core import builders

from . import jobs
from .test_builders import OWNED_LABELS, OWNER
from .test_plan_lifecycle import _run

JOB_PODS = {"matchLabels": {"cairn.dev/job-name": "demo"}}
FROM_THE_JOB = {"from": [{"podSelector": JOB_PODS}]}


def _policy(*ingress: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": "demo-ingress",
            "namespace": "ml",
            "labels": OWNED_LABELS,
            "ownerReferences": [OWNER],
        },
        "spec": {"podSelector": JOB_PODS, "policyTypes": ["Ingress"], "ingress": list(ingress)},
    }


def _ray(**spec: Any) -> Any:
    return jobs.job(runtime="ray", command=["python", "driver.py"], **spec)


def test_torchrun_job_admits_only_its_own_pods_on_every_port() -> None:
    assert builders.network_policy(jobs.job()) == _policy(FROM_THE_JOB)


def test_ray_job_without_dashboard_admits_only_its_own_pods() -> None:
    assert builders.network_policy(_ray()) == _policy(FROM_THE_JOB)


def test_ray_dashboard_port_is_open_only_when_asked_for() -> None:
    dashboard = {"ports": [{"protocol": "TCP", "port": 8265}]}
    assert builders.network_policy(_ray(ray={"dashboard": True})) == _policy(
        FROM_THE_JOB, dashboard
    )


def test_policy_is_planned_before_the_pods() -> None:
    result, _ = _run(jobs.job())
    kinds = [c["kind"] for c in result.creates]
    assert kinds.count("NetworkPolicy") == 1
    assert kinds.index("NetworkPolicy") < kinds.index("Pod")
