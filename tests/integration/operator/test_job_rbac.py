"""A job's ServiceAccount may report on its own job and on nothing else.

Covers, with a real TokenRequest token of the `<job>-trainer` ServiceAccount
the operator created and the API server's RBAC authorizer: the token can get
and patch its own job's /status (the writer's path; the patch lands), but
gets 403 patching another job's /status, 403 on its own job's spec (main
resource), and 403 listing or reading Secrets, its own job's manifest-key
Secret and another job's included (the key reaches the ranks only as a
mounted file; issue 19).
"""

import functools
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.integration.devcluster import kube_helpers as kh
from tests.integration.operator.conftest import (
    GROUP,
    PLURAL,
    SLEEP_FOREVER,
    VERSION,
    WAIT,
    Kube,
    job_body,
)

pytestmark = pytest.mark.cluster


def _forbidden(call: Callable[[], Any]) -> None:
    with pytest.raises(ApiException) as caught:
        call()
    assert caught.value.status == 403, caught.value


def test_token_reaches_only_its_own_status(kube: Kube) -> None:
    ns = kube.namespace
    kube.core.create_namespaced_secret(
        ns, client.V1Secret(metadata=client.V1ObjectMeta(name="s3"), string_data={"k": "v"})
    )
    for name in ("mine", "theirs"):
        kube.create(job_body(name, script=SLEEP_FOREVER, nodes=1))
    for name in ("mine", "theirs"):
        kube.wait_phase(name, "Running")

    as_job = kube.as_service_account("mine-trainer", pod="mine-a1-n0")
    custom = client.CustomObjectsApi(as_job)
    core = client.CoreV1Api(as_job)
    report = {"status": {"step": 7}}

    def patch_own() -> bool:
        try:
            custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, ns, PLURAL, "mine", report, field_manager="writer"
            )
        except ApiException as exc:  # the new RoleBinding may not be in RBAC's cache yet
            if exc.status == 403:
                return False
            raise
        return True

    kh.wait_for(patch_own, timeout=WAIT, what="the job's token patching its own status")
    assert kube.status("mine")["step"] == 7
    own = custom.get_namespaced_custom_object_status(GROUP, VERSION, ns, PLURAL, "mine")
    assert own["status"]["step"] == 7

    _forbidden(
        lambda: custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, ns, PLURAL, "theirs", report
        )
    )
    _forbidden(
        lambda: custom.get_namespaced_custom_object_status(GROUP, VERSION, ns, PLURAL, "theirs")
    )
    _forbidden(
        lambda: custom.patch_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL, "mine", {"spec": {"suspend": True}}
        )
    )
    _forbidden(lambda: core.list_namespaced_secret(ns))
    _forbidden(lambda: core.read_namespaced_secret("s3", ns))
    for key_secret in ("mine-manifest-key", "theirs-manifest-key"):
        kube.core.read_namespaced_secret(key_secret, ns)  # it exists, and the token...
        _forbidden(functools.partial(core.read_namespaced_secret, key_secret, ns))
    assert "step" not in kube.status("theirs")
