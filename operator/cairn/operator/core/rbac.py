"""The operator's own RBAC: every API call it makes, as least-privilege rules.

Pure data. The Helm chart's ClusterRole/Role rules are generated from here
(``charts/generate.py`` writes ``charts/cairn/files/operator-rbac.yaml``; a
drift test keeps them equal), so the rules live next to the code that needs
them. Each rule names its caller; when ``handlers``/``jobapply`` start a new
kind of call, add the rule here and regenerate.

Two scopes:

- ``NAMESPACED_RULES`` are granted where TrainingJobs are watched: cluster-wide
  through a ClusterRole + ClusterRoleBinding, or per namespace through a Role +
  RoleBinding in each watched namespace.
- ``CLUSTER_RULES`` are cluster-scoped reads needed in either mode (kopf: CRDs and
  namespaces, names and labels only; ``policycheck``: the status policy and its binding).

Secrets: ``get`` and ``create`` (no list, no watch, no update): ``s3observe``
reads the one Secret a job's ``upload.credentialsSecretRef`` names, by name,
when it verifies, applies retention or cleans up the job's S3 prefix (the pods
still get the values only through ``secretKeyRef``); ``jobapply`` creates each
job's manifest-key Secret (and a ray job's Ray token Secret) once and
``s3observe`` reads the former, by name, to check manifest signatures
(docs/security.md). Not granted on purpose: nodes, ``update`` (everything is
created, patched or deleted; the one exception is ``trainingjobs/finalizers``, which
``OwnerReferencesPermissionEnforcement`` checks before it lets a child carry
``blockOwnerDeletion``), ``escalate``/``bind`` (the per-job Role it
creates grants only ``get``/``patch`` on the job's ``/status``, which the
operator itself holds, so RBAC's escalation check passes without them).
"""

from typing import Final, TypedDict

from cairn.api import trainingjob


class PolicyRule(TypedDict):
    """rbac.authorization.k8s.io/v1 PolicyRule (the fields we use)."""

    apiGroups: list[str]
    resources: list[str]
    verbs: list[str]


def _rule(group: str, resources: list[str], verbs: list[str]) -> PolicyRule:
    return {"apiGroups": [group], "resources": resources, "verbs": verbs}


NAMESPACED_RULES: Final[tuple[PolicyRule, ...]] = (
    # handlers: kopf watches jobs, and patches metadata (finalizer, progress annotations);
    # finishedjobs.FinishedJobs deletes a finished job after spec.ttlSecondsAfterFinished.
    _rule(trainingjob.GROUP, [trainingjob.PLURAL], ["get", "list", "watch", "patch", "delete"]),
    # jobapply.apply: the status merge patch. `get` as well: the per-job Role grants
    # get/patch on /status, and RBAC only lets us grant what we hold.
    _rule(trainingjob.GROUP, [f"{trainingjob.PLURAL}/status"], ["get", "patch"]),
    # effects: children carry blockOwnerDeletion; where OwnerReferencesPermissionEnforcement
    # is on (OpenShift, the devcluster) that needs update on the owner's finalizers.
    _rule(trainingjob.GROUP, [f"{trainingjob.PLURAL}/finalizers"], ["update"]),
    # podcache: the pod list and watch; effects: create ranks, delete them.
    _rule("", ["pods"], ["get", "list", "watch", "create", "delete"]),
    # effects: the per-job headless Service and ServiceAccount.
    _rule("", ["services", "serviceaccounts"], ["get", "create", "delete"]),
    # effects: the per-job Role/RoleBinding that let rank 0 patch the job's status.
    _rule("rbac.authorization.k8s.io", ["roles", "rolebindings"], ["get", "create"]),
    # jobapply: the per-job NetworkPolicy (create; get when a create meets 409, to check
    # its owner). No list/delete: the garbage collector deletes it with the job.
    _rule("networking.k8s.io", ["networkpolicies"], ["get", "create"]),
    # effects: one Event per transition.
    _rule("", ["events"], ["create"]),
    # s3observe: the S3 credentials Secret a job names and the job's manifest-key
    # Secret (by name: get); effects: creates the manifest-key and Ray token Secrets once.
    _rule("", ["secrets"], ["get", "create"]),
)

CLUSTER_RULES: Final[tuple[PolicyRule, ...]] = (
    # kopf: notices CRDs appearing/disappearing at runtime (read-only).
    _rule("apiextensions.k8s.io", ["customresourcedefinitions"], ["list", "watch"]),
    # kopf: observes namespaces (even for explicit --namespace names, it lists
    # them at startup and retries forever on 403; measured on the devcluster).
    _rule("", ["namespaces"], ["list", "watch"]),
    # policycheck: the status ValidatingAdmissionPolicy and its binding, by name
    # (no pods start without them: core.policygate).
    _rule(
        "admissionregistration.k8s.io",
        ["validatingadmissionpolicies", "validatingadmissionpolicybindings"],
        ["get"],
    ),
)


KUEUE_RULES: Final[tuple[PolicyRule, ...]] = (
    # kueueapply: one Workload per queued job (create), its priority-boost annotation and
    # spec.active (patch); handlers: the Workload watch that wakes the job's reconcile.
    _rule("kueue.x-k8s.io", ["workloads"], ["get", "list", "watch", "create", "patch"]),
    # kueueapply: after an eviction, release the quota (clear status.admission, conditions);
    # Finished=True when the job ends.
    _rule("kueue.x-k8s.io", ["workloads/status"], ["get", "patch"]),
)
"""Granted where TrainingJobs are watched, with the chart's ``rbac.kueue`` (default on)."""

KUEUE_CLUSTER_RULES: Final[tuple[PolicyRule, ...]] = (
    # kueueapply: the admitted flavors' node labels and tolerations; a queued job's
    # WorkloadPriorityClass value (v1beta2 Workloads carry it next to the reference).
    _rule("kueue.x-k8s.io", ["resourceflavors", "workloadpriorityclasses"], ["get"]),
)


LEADER_RULES: Final[tuple[PolicyRule, ...]] = (
    # leader: the election Lease, in the operator's own namespace only.
    _rule("coordination.k8s.io", ["leases"], ["get", "create", "update"]),
)


def rules() -> dict[str, list[PolicyRule]]:
    """The rule sets, keyed as the chart reads them (``namespaced``, ``cluster``,
    ``leader``: a Role in the release namespace when leader election is on;
    ``kueueplan``/``kueueCluster``: added to the first two with ``rbac.kueue``)."""
    return {
        "namespaced": list(NAMESPACED_RULES),
        "cluster": list(CLUSTER_RULES),
        "leader": list(LEADER_RULES),
        "kueue": list(KUEUE_RULES),
        "kueueCluster": list(KUEUE_CLUSTER_RULES),
    }
