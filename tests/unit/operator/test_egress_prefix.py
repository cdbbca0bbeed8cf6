"""The operator's egress gate and nested-prefix refusal, as decisions (issue #20 items 5, 6).

Covers: addresses the operator never calls (IPv4/IPv6 loopback, an
IPv4-mapped loopback, link-local v4/v6 with a zone index, 0.0.0.0, the
cluster's Service and pod CIDRs), a public address passing, a name that
resolves to loopback (``localhost``, through the real resolver), a name that
does not resolve and a resolver past its deadline (refused, generic), an
allow-listed endpoint exempt and never resolved, the status message never
echoing the address; the cluster networks setting (default, from the
environment, a bad CIDR named); nesting (``a/b`` vs ``a/bc`` not nested,
``a`` around ``a/b``, ``a/b`` inside ``a``, the same prefix left to the
owner object, another bucket or another endpoint fine, the bucket root
around everything, the older job keeps it, a job refused before any S3 call
keeps nothing); the index by store and bucket (note, replace, forget).
"""

import datetime
import threading

import pytest

from cairn.api import checkpointspec, trainingjob
from cairn.operator import egress, prefixindex
from cairn.operator.core import egressplan, prefixplan

CLUSTER = egressplan.parse_networks(prefixplan.DEFAULT_CLUSTER_NETWORKS, what="test")
SECRET = {"credentialsSecretRef": {"name": "s3"}}


def upload(**fields: object) -> checkpointspec.UploadSpec:
    return checkpointspec.UploadSpec.model_validate({"uri": "s3://bkt/p", **SECRET, **fields})


@pytest.mark.parametrize(
    ("address", "label"),
    [
        pytest.param("127.0.0.1", "loopback", id="ipv4-loopback"),
        pytest.param("127.3.2.1", "loopback", id="ipv4-loopback-range"),
        pytest.param("::1", "loopback", id="ipv6-loopback"),
        pytest.param("::ffff:127.0.0.1", "loopback", id="ipv4-mapped-loopback"),
        pytest.param("169.254.169.254", "link-local", id="cloud-metadata"),
        pytest.param("fe80::1%eth0", "link-local", id="ipv6-link-local-zone"),
        pytest.param("0.0.0.0", "this host", id="unspecified"),
        pytest.param("10.96.0.1", "cluster network 10.96.0.0/12", id="service-cidr"),
        pytest.param("10.244.3.7", "cluster network 10.244.0.0/16", id="pod-cidr"),
        pytest.param("not-an-ip", "not an IP address", id="garbage"),
        pytest.param("93.184.215.14", None, id="public-v4"),
        pytest.param("2606:4700::1", None, id="public-v6"),
        pytest.param("10.0.0.5", None, id="private-outside-cluster-ranges"),
    ],
)
def test_classify(address: str, label: str | None) -> None:
    assert egressplan.classify(address, cluster=CLUSTER) == label


def test_one_refused_address_among_several_refuses_and_the_status_is_generic() -> None:
    found = egressplan.refusal(host="s3.example", addresses=("93.184.215.14", "::1"), cluster=())
    assert found is not None
    assert found.claim.reason == prefixplan.REASON_ADDRESS
    assert found.claim.message == egressplan.REFUSED_MESSAGE
    assert "::1" not in found.claim.message and "s3.example" not in found.claim.message
    assert "::1" in found.detail  # for the operator log only


def test_no_address_is_refused() -> None:
    assert egressplan.refusal(host="h", addresses=(), cluster=()) is not None


def test_name_resolving_to_loopback_is_refused() -> None:
    got = egress.refusal(upload(endpoint="http://localhost:8333"), prefixplan.Settings(), job="n/j")
    assert got is not None and got.reason == prefixplan.REASON_ADDRESS
    assert got.message == egressplan.REFUSED_MESSAGE


@pytest.mark.parametrize(
    "endpoint",
    [
        pytest.param("http://127.0.0.1:8333", id="ipv4-literal"),
        pytest.param("http://[::1]:8333", id="ipv6-literal"),
        pytest.param("http://169.254.169.254", id="link-local"),
        pytest.param("http://10.96.0.10:80", id="service-cidr"),
        pytest.param("http://name.invalid:9000", id="unresolvable"),
    ],
)
def test_endpoint_refused_without_an_allow_list(endpoint: str) -> None:
    got = egress.refusal(upload(endpoint=endpoint), prefixplan.Settings(), job="n/j")
    assert got is not None and got.message == egressplan.REFUSED_MESSAGE


def test_allow_listed_endpoint_is_exempt_and_not_resolved(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_lookup(host: str, port: int, *, deadline: float = 0) -> tuple[str, ...]:
        raise AssertionError(f"resolved {host}")

    monkeypatch.setattr(egress, "resolve", no_lookup)
    config = prefixplan.Settings(endpoint_allow_list=("http://127.0.0.1:8333",))
    assert egress.refusal(upload(endpoint="http://127.0.0.1:8333/"), config, job="n/j") is None
    assert egress.refusal(upload(), prefixplan.Settings(), job="n/j") is None  # SDK default


def test_resolver_past_its_deadline_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()

    def hung(host: str, port: int) -> tuple[str, ...]:
        release.wait(10)  # a resolver that never answers (released at the end)
        return ("93.184.215.14",)

    monkeypatch.setattr(egress, "_lookup", hung)
    try:
        got = egress.refusal(
            upload(endpoint="http://s3.example"), prefixplan.Settings(), job="n/j", deadline=0.05
        )
    finally:
        release.set()
    assert got is not None and got.message == egressplan.REFUSED_MESSAGE


def test_cluster_networks_setting() -> None:
    assert prefixplan.Settings.from_env({}).cluster_networks == prefixplan.DEFAULT_CLUSTER_NETWORKS
    got = prefixplan.Settings.from_env({prefixplan.ENV_CLUSTER_NETWORKS: " 10.0.0.0/8 ,fd00::/8"})
    assert got.cluster_networks == ("10.0.0.0/8", "fd00::/8")
    assert (
        prefixplan.Settings.from_env({prefixplan.ENV_CLUSTER_NETWORKS: ""}).cluster_networks == ()
    )
    with pytest.raises(ValueError, match=prefixplan.ENV_CLUSTER_NETWORKS):
        prefixplan.Settings.from_env({prefixplan.ENV_CLUSTER_NETWORKS: "10.0.0.0/33"})


T0 = datetime.datetime(2026, 11, 27, 9, 0, tzinfo=datetime.UTC)


def tjob(
    uri: str, *, name: str = "a", minute: int = 0, endpoint: str | None = "http://s3:9000"
) -> trainingjob.TrainingJob:
    return trainingjob.TrainingJob.model_validate(
        {
            "apiVersion": "cairn.dev/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {
                "name": name,
                "namespace": "ml",
                "uid": f"uid-{name}",
                "creationTimestamp": (T0 + datetime.timedelta(minutes=minute)).isoformat(),
            },
            "spec": {
                "image": "cairn-trainer:dev",
                "nodes": 1,
                "checkpoint": {"upload": {"uri": uri, "endpoint": endpoint, **SECRET}},
            },
        }
    )


def use(
    uri: str,
    *,
    name: str = "a",
    minute: int = 0,
    endpoint: str | None = "http://s3:9000",
    gave_up: bool = False,
) -> prefixplan.PrefixUse:
    reason = prefixplan.REASON_IDENTITY if gave_up else None
    job = tjob(uri, name=name, minute=minute, endpoint=endpoint)
    found = prefixplan.PrefixUse.of(job, claim_reason=reason)
    assert found is not None
    return found


@pytest.mark.parametrize(
    ("mine", "other", "nested"),
    [
        pytest.param("s3://bkt/a/b", "s3://bkt/a/bc", False, id="a/b-vs-a/bc-not-nested"),
        pytest.param("s3://bkt/a/b", "s3://bkt/a", True, id="a/b-inside-a"),
        pytest.param("s3://bkt/a", "s3://bkt/a/b", True, id="a-around-a/b"),
        pytest.param("s3://bkt/a/b/", "s3://bkt/a/", True, id="trailing-slashes"),
        pytest.param("s3://bkt/a", "s3://bkt/a", False, id="same-prefix-is-the-owner-objects"),
        pytest.param("s3://bkt/a/b", "s3://other/a", False, id="same-prefix-other-bucket"),
        pytest.param("s3://bkt/x", "s3://bkt", True, id="bucket-root-around-everything"),
    ],
)
def test_nested(mine: str, other: str, nested: bool) -> None:
    assert prefixplan.nested(use(mine, name="m"), use(other, name="o")) is nested


def test_other_endpoint_is_another_store() -> None:
    assert not prefixplan.nested(
        use("s3://bkt/a/b", name="m"), use("s3://bkt/a", name="o", endpoint="http://s3b:9000")
    )


def test_inner_job_created_later_is_refused_naming_the_outer() -> None:
    outer, inner = use("s3://bkt/a", name="outer"), use("s3://bkt/a/b", name="inner", minute=1)
    refused = prefixplan.nested_refusal(mine=inner, others=(outer,))
    assert refused is not None and refused.reason == prefixplan.REASON_NESTED
    assert "inside" in refused.message and "TrainingJob ml/outer" in refused.message
    assert prefixplan.nested_refusal(mine=outer, others=(inner,)) is None  # the older keeps it


def test_outer_job_created_later_is_refused_naming_the_inner() -> None:
    inner, outer = use("s3://bkt/a/b", name="inner"), use("s3://bkt/a", name="outer", minute=1)
    refused = prefixplan.nested_refusal(mine=outer, others=(inner,))
    assert refused is not None and "around" in refused.message and "ml/inner" in refused.message


def test_older_job_refused_before_any_s3_call_keeps_nothing() -> None:
    outer = use("s3://bkt/a", name="outer", gave_up=True)
    assert (
        prefixplan.nested_refusal(mine=use("s3://bkt/a/b", name="i", minute=1), others=(outer,))
        is None
    )


def test_index_groups_by_store_and_forgets() -> None:
    index = prefixindex.PrefixIndex()
    refused = {"status": {"storage": {"claim": {"reason": prefixplan.REASON_ENDPOINT}}}}
    index.note(("ml", "one"), tjob("s3://bkt/a", name="one"), {})
    index.note(("ml", "off"), tjob("s3://bkt/a", name="off"), refused)
    two = use("s3://bkt/a/b", name="two", minute=1)
    assert [(u.name, u.gave_up) for u in index.sharing(two)] == [("one", False), ("off", True)]
    assert index.sharing(use("s3://ccc/a", name="three")) == ()
    index.note(("ml", "one"), tjob("s3://ccc/a", name="one"), {})  # moved to another bucket
    assert [u.name for u in index.sharing(two)] == ["off"]
    index.forget(("ml", "one"))
    index.forget(("ml", "off"))
    assert index.sharing(two) == () and len(index) == 0


def test_claim_reason_of_a_body() -> None:
    body = {"status": {"storage": {"claim": {"reason": "PrefixOwned"}}}}
    assert prefixindex.claim_reason(body) == "PrefixOwned"
    assert prefixindex.claim_reason({"status": None}) is None
    assert prefixindex.claim_reason({"status": {"storage": {"claim": {"reason": 3}}}}) is None
