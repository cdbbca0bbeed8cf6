"""Deterministic names and labels of a job's children.

Pure. Names derive from the job name and the attempt, so a create repeated
after a crash hits 409 instead of making a duplicate, and the attempt label
separates an old gang from the new one.
"""

from cairn.api import podidentity, trainingjob

# The labels and the pod name are shared with the kubectl plugin (one rule
# for "the job's own pod": ``cairn.api.podidentity``).
LABEL_JOB = podidentity.LABEL_JOB
LABEL_ATTEMPT = podidentity.LABEL_ATTEMPT
LABEL_RANK = podidentity.LABEL_RANK
pod_name = podidentity.pod_name
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "cairn"
CONTAINER = "trainer"
PORT_NAME = "c10d"
FIELD_MANAGER = "cairn-operator"


def service_name(job: str) -> str:
    """The headless Service; pods use it as their subdomain."""
    return job


def service_account_name(job: str) -> str:
    return f"{job}-trainer"


def role_name(job: str) -> str:
    return f"{job}-status-writer"


def manifest_key_secret_name(job: str) -> str:
    """The job's manifest-signing keyring (docs/security.md, "Authenticated manifests")."""
    return f"{job}-manifest-key"


def ray_token_secret_name(job: str) -> str:
    """A ``runtime: ray`` job's Ray auth token (docs/security.md, "Ray token auth")."""
    return f"{job}-ray-token"


def network_policy_name(job: str) -> str:
    """The job's ingress boundary (docs/security.md, "The job's network boundary")."""
    return f"{job}-ingress"


def master_addr(*, job: str, namespace: str, attempt: int) -> str:
    """Rank 0's stable DNS name under the headless Service."""
    host = pod_name(job=job, attempt=attempt, rank=0)
    return f"{host}.{service_name(job)}.{namespace}.svc.cluster.local"


def job_selector(job: str) -> dict[str, str]:
    return {LABEL_JOB: job}


def pod_labels(*, job: str, attempt: int, rank: int) -> dict[str, str]:
    return {
        LABEL_JOB: job,
        LABEL_ATTEMPT: str(attempt),
        LABEL_RANK: str(rank),
        LABEL_MANAGED_BY: MANAGED_BY,
    }


def owner_labels(job: str) -> dict[str, str]:
    return {LABEL_JOB: job, LABEL_MANAGED_BY: MANAGED_BY}


API_VERSION = trainingjob.API_VERSION
