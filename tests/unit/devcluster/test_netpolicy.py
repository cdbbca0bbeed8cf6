"""The node agent's pure NetworkPolicy computation (`agent.netpolicy`).

Covers, each a case: default allow when no policy selects a pod; policyTypes
(absent means Ingress, Egress-only isolates nothing); podSelector with
matchLabels and with matchExpressions (In, NotIn, Exists, DoesNotExist, an
unknown operator matching nothing); a policy of another namespace ignoring
the pod; ingress `from` podSelector (same namespace only), namespaceSelector
alone, both together, ipBlock with `except`, an empty rule allowing all and
an empty `ingress` allowing nothing; `ports` by number, `endPort` ranges,
protocol, named container ports (and an unknown name allowing nothing);
pods without an address or finished not being peers; several policies
adding up; and the rendered nftables text: loopback, established traffic
and the node always allowed, drop otherwise, a not-isolated pod's table
removed, and hostile strings never reaching the script.
"""

import ipaddress
from typing import Any

from cairn.devcluster.agent import netpolicy as npol

JOB = {"cairn.dev/job-name": "j1"}


def _pod(
    name: str, ip: str | None, *, ns: str = "team", labels: dict[str, str] | None = None, **kw: Any
) -> dict[str, Any]:
    status = {"phase": kw.get("phase", "Running")}
    if ip is not None:
        status["podIP"] = ip
    ports = kw.get("ports", [])
    return {
        "metadata": {"name": name, "namespace": ns, "labels": labels or {}},
        "spec": {"containers": [{"name": "c", "ports": ports}]},
        "status": status,
    }


def _ns(name: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels}}


def _policy(spec: dict[str, Any], *, ns: str = "team", name: str = "p") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": ns}, "spec": spec}


def _job_policy(**extra: Any) -> dict[str, Any]:
    rule = {"from": [{"podSelector": {"matchLabels": JOB}}], **extra}
    return _policy({"podSelector": {"matchLabels": JOB}, "ingress": [rule]})


A, B, C = (
    _pod("a", "10.244.1.2", labels=JOB),
    _pod("b", "10.244.1.3", labels=JOB),
    _pod("c", "10.244.1.4"),
)
NAMESPACES = [_ns("team", tier="a"), _ns("other", tier="b")]


def _plans(policies: list[dict[str, Any]], pods: list[dict[str, Any]]) -> dict[str, Any]:
    return npol.ingress_plans(policies=policies, pods=pods, namespaces=NAMESPACES)


def _sources(plan: Any) -> set[str]:
    return {str(p.network) for allow in plan for p in allow.peers or ()}


def test_no_policy_allows_everything() -> None:
    assert _plans([], [A, B, C]) == {"team/a": None, "team/b": None, "team/c": None}


def test_job_policy_isolates_job_pods_and_allows_only_job_peers() -> None:
    plans = _plans([_job_policy()], [A, B, C])
    assert plans["team/c"] is None
    assert _sources(plans["team/a"]) == {"10.244.1.2/32", "10.244.1.3/32"}
    assert plans["team/a"][0].ports is None


def test_policy_types_absent_means_ingress_and_egress_only_isolates_nothing() -> None:
    egress_only = _policy({"podSelector": {}, "policyTypes": ["Egress"]})
    assert _plans([egress_only], [A])["team/a"] is None
    both = _policy({"podSelector": {}, "policyTypes": ["Ingress", "Egress"]})
    assert _plans([both], [A])["team/a"] == ()


def test_deny_all_ingress_empty_rules() -> None:
    assert _plans([_policy({"podSelector": {}})], [A, C]) == {"team/a": (), "team/c": ()}


def test_match_expressions() -> None:
    def selects(expr: dict[str, Any]) -> bool:
        spec = {"podSelector": {"matchExpressions": [expr]}}
        return _plans([_policy(spec)], [A])["team/a"] is not None

    key = "cairn.dev/job-name"
    assert selects({"key": key, "operator": "In", "values": ["j1", "j2"]})
    assert not selects({"key": key, "operator": "In", "values": ["j2"]})
    assert selects({"key": key, "operator": "NotIn", "values": ["j2"]})
    assert not selects({"key": key, "operator": "NotIn", "values": ["j1"]})
    assert selects({"key": key, "operator": "Exists"})
    assert not selects({"key": key, "operator": "DoesNotExist"})
    assert not selects({"key": key, "operator": "Matches", "values": ["j1"]})


def test_policy_in_another_namespace_does_not_select() -> None:
    foreign = _policy({"podSelector": {}}, ns="other")
    assert _plans([foreign], [A])["team/a"] is None


def test_pod_selector_peers_are_same_namespace_only() -> None:
    twin = _pod("twin", "10.244.1.9", ns="other", labels=JOB)
    assert _sources(_plans([_job_policy()], [A, twin])["team/a"]) == {"10.244.1.2/32"}


def test_namespace_selector_alone_and_with_pod_selector() -> None:
    stranger = _pod("s", "10.244.1.8", ns="other")
    member = _pod("m", "10.244.1.9", ns="other", labels=JOB)
    by_ns = {"from": [{"namespaceSelector": {"matchLabels": {"tier": "b"}}}]}
    policy = _policy({"podSelector": {}, "ingress": [by_ns]})
    assert _sources(_plans([policy], [A, stranger, member])["team/a"]) == {
        "10.244.1.8/32",
        "10.244.1.9/32",
    }
    both = {
        "from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": JOB}}],
    }
    policy = _policy({"podSelector": {}, "ingress": [both]})
    assert _sources(_plans([policy], [A, stranger, member])["team/a"]) == {
        "10.244.1.2/32",
        "10.244.1.9/32",
    }


def test_ip_block_with_except() -> None:
    block = {"ipBlock": {"cidr": "10.244.0.0/16", "except": ["10.244.1.4/32", "fe80::/10"]}}
    plan = _plans([_policy({"podSelector": {}, "ingress": [{"from": [block]}]})], [A])["team/a"]
    (peer,) = plan[0].peers
    assert peer.network == ipaddress.IPv4Network("10.244.0.0/16")
    assert peer.excepts == (ipaddress.IPv4Network("10.244.1.4/32"),)


def test_malformed_ip_block_allows_nothing() -> None:
    block = {"ipBlock": {"cidr": "10.0.0.0/8; flush ruleset"}}
    plan = _plans([_policy({"podSelector": {}, "ingress": [{"from": [block]}]})], [A])["team/a"]
    assert plan == ()


def test_empty_rule_allows_all_sources_and_ports() -> None:
    plan = _plans([_policy({"podSelector": {}, "ingress": [{}]})], [A])["team/a"]
    assert plan == (npol.Allow(peers=None, ports=None),)


def test_ports_numbers_ranges_protocols() -> None:
    ports = [
        {"port": 29500},
        {"protocol": "UDP", "port": 5000, "endPort": 5010},
        {"protocol": "ICMP", "port": 1},
        {"port": 70000},
        {"port": {"not": "a port"}},
    ]
    plan = _plans([_job_policy(ports=ports)], [A, B])["team/a"]
    assert plan[0].ports == (
        npol.PortRange(protocol="TCP", first=29500, last=29500),
        npol.PortRange(protocol="UDP", first=5000, last=5010),
    )


def test_named_port_resolves_on_the_target_pod() -> None:
    named = _pod("n", "10.244.1.5", labels=JOB, ports=[{"name": "store", "containerPort": 29500}])
    plans = _plans([_job_policy(ports=[{"port": "store"}])], [named, A])
    assert plans["team/n"][0].ports == (npol.PortRange(protocol="TCP", first=29500, last=29500),)
    assert plans["team/a"] == ()  # A names no such port: the rule allows nothing there


def test_pods_without_address_or_finished_are_not_peers() -> None:
    pending = _pod("p", None, labels=JOB)
    done = _pod("d", "10.244.1.7", labels=JOB, phase="Succeeded")
    assert _sources(_plans([_job_policy()], [A, pending, done])["team/a"]) == {"10.244.1.2/32"}


def test_several_policies_add_up() -> None:
    from_c = _policy(
        {"podSelector": {}, "ingress": [{"from": [{"podSelector": {"matchLabels": {}}}]}]},
        name="all",
    )
    plan = _plans([_job_policy(), from_c], [A, B, C])["team/a"]
    assert _sources(plan) == {"10.244.1.2/32", "10.244.1.3/32", "10.244.1.4/32"}


def test_targets_limit_the_pods_planned() -> None:
    plans = npol.ingress_plans(
        policies=[_job_policy()], pods=[A, B, C], namespaces=NAMESPACES, targets=["team/b"]
    )
    assert list(plans) == ["team/b"]


def test_script_for_isolated_pod() -> None:
    plan = _plans([_job_policy(ports=[{"port": 29500}])], [A, B])["team/a"]
    script = npol.nft_script(plan)
    assert "policy drop;" in script
    for line in (
        'iifname "lo" accept',
        "ct state established,related accept",
        "ip saddr 10.244.0.1 accept",
        "ip saddr 10.244.1.3/32 tcp dport 29500 accept",
    ):
        assert line in script


def test_script_for_unselected_pod_only_removes_the_table() -> None:
    assert npol.nft_script(None) == "table inet cairn_netpol {}\ndelete table inet cairn_netpol\n"


def test_hostile_labels_and_names_never_reach_the_script() -> None:
    evil = '"; flush ruleset; "'
    pod = _pod("x", "10.244.1.6", labels={"k": evil}, ports=[{"name": evil, "containerPort": 1}])
    policy = _policy(
        {"podSelector": {"matchLabels": {"k": evil}}, "ingress": [{"ports": [{"port": evil}]}]}
    )
    script = npol.nft_script(_plans([policy], [pod])["team/x"])
    assert "flush" not in script and "dport 1 accept" in script
