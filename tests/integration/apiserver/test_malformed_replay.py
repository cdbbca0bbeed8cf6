"""The malformed TrainingJobs of tests/unit/api/malformed_cases.py, against the real API server.

Covers: with the generated CRD installed, the real kube-apiserver rejects
every case in `malformed_cases.CASES` on create (dry run): `schema` and
`cel` cases with 422 Invalid, `strict` cases (unknown fields) with 400
BadRequest under `fieldValidation=Strict` (kubectl's default), and the
message names the case's field. The control: the unmodified BASE body is
accepted, so each rejection is caused by its case's change.
"""

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests import demo
from tests.conftest import DevclusterHandle
from tests.unit.api import malformed_cases

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def custom(devcluster: DevclusterHandle) -> client.CustomObjectsApi:
    demo.install_crd(devcluster.api_client)
    return client.CustomObjectsApi(devcluster.api_client)


def _create(custom: client.CustomObjectsApi, body: dict[str, object], *, strict: bool) -> None:
    custom.create_namespaced_custom_object(
        demo.GROUP,
        demo.VERSION,
        "default",
        demo.PLURAL,
        body,
        dry_run="All",
        field_validation="Strict" if strict else None,
    )


def test_base_is_accepted(custom: client.CustomObjectsApi) -> None:
    _create(
        custom,
        malformed_cases.build(malformed_cases.Case(id="base", patch={}, field="")),
        strict=True,
    )


@pytest.mark.parametrize("case", malformed_cases.CASES, ids=lambda c: c.id)
def test_rejected_naming_the_field(
    custom: client.CustomObjectsApi, case: malformed_cases.Case
) -> None:
    strict = case.server == "strict"
    with pytest.raises(ApiException) as caught:
        _create(custom, malformed_cases.build(case), strict=strict)
    error = caught.value
    assert error.status == (400 if strict else 422), error.body
    assert case.field in error.body, f"{case.field!r} not named in {error.body}"
