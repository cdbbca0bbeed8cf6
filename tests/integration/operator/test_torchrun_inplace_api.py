"""``spec.torchrun`` against the real API server (the CRD's CEL rules).

Covers: ``spec.torchrun`` refused with ``runtime: ray``; an in-place budget
refused above 10 nodes (c10d orders nodes by host name) and accepted at 10 or
with a budget of 0; a budget with an explicit ``checkpoint.resume`` (step,
uri, none) refused, ``latest`` accepted; the default (no ``spec.torchrun``)
unchanged.
"""

from typing import Any

import pytest
from kubernetes.client.rest import ApiException

from tests.integration.operator.conftest import SLEEP_FOREVER, Kube, job_body

pytestmark = pytest.mark.cluster


def _invalid(kube: Kube, body: dict[str, Any], needle: str) -> None:
    with pytest.raises(ApiException) as caught:
        kube.create(body)
    assert caught.value.status == 422, caught.value
    assert needle in str(caught.value.body)


def test_cel_rules(kube: Kube) -> None:
    ray = job_body("ray", script=SLEEP_FOREVER, nodes=1, runtime="ray")
    ray["spec"]["torchrun"] = {"maxInPlaceRestarts": 1}
    _invalid(kube, ray, "spec.torchrun is allowed only with runtime: torchrun")
    eleven = job_body(
        "eleven", script=SLEEP_FOREVER, nodes=11, suspend=True, torchrun={"maxInPlaceRestarts": 1}
    )
    _invalid(kube, eleven, "torchrun.maxInPlaceRestarts needs nodes")
    ten = job_body(
        "ten", script=SLEEP_FOREVER, nodes=10, suspend=True, torchrun={"maxInPlaceRestarts": 1}
    )
    assert kube.create(ten)["spec"]["torchrun"] == {"maxInPlaceRestarts": 1}
    zero = job_body(
        "zero", script=SLEEP_FOREVER, nodes=11, suspend=True, torchrun={"maxInPlaceRestarts": 0}
    )
    assert kube.create(zero)["spec"]["nodes"] == 11
    pinned = job_body(
        "pinned", script=SLEEP_FOREVER, nodes=1, suspend=True, torchrun={"maxInPlaceRestarts": 1}
    )
    pinned["spec"]["checkpoint"]["resume"] = {"step": 10}
    _invalid(kube, pinned, "torchrun.maxInPlaceRestarts needs checkpoint.resume unset or latest")
    pinned["spec"]["checkpoint"]["resume"] = {"latest": True}
    assert kube.create(pinned)["spec"]["checkpoint"]["resume"] == {"latest": True}
    plain = kube.create(job_body("plain", script=SLEEP_FOREVER, nodes=1, suspend=True))
    assert "torchrun" not in plain["spec"]
