"""Pure: NetworkPolicy ingress semantics → per-pod allow-lists → nftables text.

`ingress_plans` takes the API's own JSON shapes (NetworkPolicies, pods,
namespaces; all untrusted) and returns, for every pod, either `None` (no
policy with type Ingress selects it: all ingress allowed) or the tuple of
`Allow` rules that the union of the selecting policies' ingress rules
permits. `nft_script` renders one plan as an nftables script for the pod's
own network namespace (an INPUT hook there sees every packet addressed to
the pod). Every address, port and protocol is parsed and re-rendered from
typed values, so nothing a manifest says reaches nft as text.

Covered: podSelector (matchLabels, matchExpressions), policyTypes (absent
means Ingress), ingress `from` podSelector / namespaceSelector / both /
ipBlock (with `except`), `ports` (TCP/UDP/SCTP numbers, `endPort` ranges,
named container ports). Egress rules are not enforced (documented in
docs/devcluster.md). IPv4 only, as the devcluster's pod network is.
"""

import dataclasses
import ipaddress
from collections.abc import Iterable, Mapping
from typing import Any

Obj = Mapping[str, Any]
NODE_ADDRESS = "10.244.0.1"
"""The bridge gateway, i.e. the node itself (agent, operator on the host):
always allowed in, as most CNIs let the node reach its own pods (probes)."""
PROTOCOLS = ("TCP", "UDP", "SCTP")
TABLE = "cairn_netpol"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Peer:
    network: ipaddress.IPv4Network
    excepts: tuple[ipaddress.IPv4Network, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PortRange:
    protocol: str
    first: int
    last: int


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Allow:
    """One ingress rule resolved for one pod; `None` means any peer / any port."""

    peers: tuple[Peer, ...] | None
    ports: tuple[PortRange, ...] | None


Plan = tuple[Allow, ...] | None


def pod_key(pod: Obj) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def selector_matches(selector: Obj | None, labels: Mapping[str, str]) -> bool:
    """LabelSelector semantics; a malformed selector matches nothing."""
    if selector is None:
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    expressions = selector.get("matchExpressions") or ()
    return all(_expression_matches(expr, labels) for expr in expressions)


def _expression_matches(expr: Obj, labels: Mapping[str, str]) -> bool:
    key, op = str(expr.get("key", "")), expr.get("operator")
    values = set(expr.get("values") or ())
    if op == "In":
        return key in labels and labels[key] in values
    if op == "NotIn":
        return key not in labels or labels[key] not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    return False


def _labels(obj: Obj) -> Mapping[str, str]:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return {str(k): str(v) for k, v in labels.items()}


def _pod_ip(pod: Obj) -> ipaddress.IPv4Address | None:
    status = pod.get("status") or {}
    if status.get("phase") in ("Succeeded", "Failed"):
        return None
    try:
        address = ipaddress.ip_address(str(status.get("podIP") or ""))
    except ValueError:
        return None
    return address if isinstance(address, ipaddress.IPv4Address) else None


def _applies_to_ingress(policy: Obj) -> bool:
    types = (policy.get("spec") or {}).get("policyTypes")
    return types is None or "Ingress" in types


def _selects(policy: Obj, pod: Obj) -> bool:
    meta, pod_meta = policy.get("metadata") or {}, pod.get("metadata") or {}
    if meta.get("namespace") != pod_meta.get("namespace"):
        return False
    return selector_matches((policy.get("spec") or {}).get("podSelector"), _labels(pod))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _World:
    pods: tuple[Obj, ...]
    namespace_labels: Mapping[str, Mapping[str, str]]


def _peer_pods(peer: Obj, *, policy_namespace: str, world: _World) -> list[Peer]:
    pod_selector, ns_selector = peer.get("podSelector"), peer.get("namespaceSelector")
    found = []
    for pod in world.pods:
        address = _pod_ip(pod)
        namespace = (pod.get("metadata") or {}).get("namespace", "")
        if address is None:
            continue
        if ns_selector is None:
            in_scope = namespace == policy_namespace
        else:
            in_scope = selector_matches(ns_selector, world.namespace_labels.get(namespace, {}))
        if not in_scope:
            continue
        if pod_selector is not None and not selector_matches(pod_selector, _labels(pod)):
            continue
        found.append(Peer(network=ipaddress.IPv4Network(f"{address}/32")))
    return found


def _ip_block(block: Obj) -> list[Peer]:
    try:
        network = ipaddress.ip_network(str(block.get("cidr", "")), strict=False)
        excepts = [ipaddress.ip_network(str(e), strict=False) for e in block.get("except") or ()]
    except ValueError:
        return []  # malformed: allows nothing
    if not isinstance(network, ipaddress.IPv4Network):
        return []
    return [
        Peer(
            network=network,
            excepts=tuple(e for e in excepts if isinstance(e, ipaddress.IPv4Network)),
        )
    ]


def _peers(rule: Obj, *, policy_namespace: str, world: _World) -> tuple[Peer, ...] | None:
    sources = rule.get("from")
    if not sources:
        return None
    peers: list[Peer] = []
    for peer in sources:
        if peer.get("ipBlock") is not None:
            peers += _ip_block(peer["ipBlock"])
        elif peer.get("podSelector") is not None or peer.get("namespaceSelector") is not None:
            peers += _peer_pods(peer, policy_namespace=policy_namespace, world=world)
    return tuple(sorted(set(peers), key=lambda p: (int(p.network.network_address), p.excepts)))


def _named_port(pod: Obj, *, name: str, protocol: str) -> int | None:
    spec = pod.get("spec") or {}
    for container in [*(spec.get("containers") or ()), *(spec.get("initContainers") or ())]:
        for port in container.get("ports") or ():
            if port.get("name") == name and (port.get("protocol") or "TCP") == protocol:
                number = port.get("containerPort")
                return number if isinstance(number, int) else None
    return None


def _port_range(entry: Obj, *, target: Obj) -> PortRange | None:
    protocol = entry.get("protocol") or "TCP"
    if protocol not in PROTOCOLS:
        return None
    port, end = entry.get("port"), entry.get("endPort")
    if port is None:
        return PortRange(protocol=protocol, first=1, last=65535)
    if isinstance(port, bool) or not isinstance(port, int | str):
        return None
    if isinstance(port, str) and not port.isdigit():
        number = _named_port(target, name=port, protocol=protocol)
        return None if number is None else PortRange(protocol=protocol, first=number, last=number)
    first = int(port)
    last = end if isinstance(end, int) and end >= first else first
    if not 1 <= first <= last <= 65535:
        return None
    return PortRange(protocol=protocol, first=first, last=last)


def _ports(rule: Obj, *, target: Obj) -> tuple[PortRange, ...] | None:
    entries = rule.get("ports")
    if not entries:
        return None
    ranges = {r for e in entries if (r := _port_range(e, target=target)) is not None}
    return tuple(sorted(ranges, key=lambda r: (r.protocol, r.first, r.last)))


def _plan_for(pod: Obj, *, policies: Iterable[Obj], world: _World) -> Plan:
    selecting = [p for p in policies if _applies_to_ingress(p) and _selects(p, pod)]
    if not selecting:
        return None
    allows: list[Allow] = []
    for policy in selecting:
        namespace = (policy.get("metadata") or {}).get("namespace", "")
        for rule in (policy.get("spec") or {}).get("ingress") or ():
            peers = _peers(rule, policy_namespace=namespace, world=world)
            ports = _ports(rule, target=pod)
            if peers == () or ports == ():
                continue  # matches no source or no port: allows nothing
            allows.append(Allow(peers=peers, ports=ports))
    return tuple(dict.fromkeys(allows))


def ingress_plans(
    *,
    policies: Iterable[Obj],
    pods: Iterable[Obj],
    namespaces: Iterable[Obj],
    targets: Iterable[str] | None = None,
) -> dict[str, Plan]:
    """For each target pod (`namespace/name`; default all): `None` if not isolated,
    else its allow rules. `pods` are every pod, the possible peers."""
    pod_list = tuple(pods)
    policy_list = tuple(policies)
    wanted = None if targets is None else set(targets)
    world = _World(
        pods=pod_list,
        namespace_labels={
            (n.get("metadata") or {}).get("name", ""): _labels(n) for n in namespaces
        },
    )
    return {
        pod_key(p): _plan_for(p, policies=policy_list, world=world)
        for p in pod_list
        if wanted is None or pod_key(p) in wanted
    }


def _peer_match(peer: Peer) -> str:
    text = f"ip saddr {peer.network}"
    if peer.excepts:
        text += " ip saddr != { " + ", ".join(str(e) for e in peer.excepts) + " }"
    return text


def _port_match(port: PortRange) -> str:
    span = str(port.first) if port.first == port.last else f"{port.first}-{port.last}"
    return f"{port.protocol.lower()} dport {span}"


def _rule_lines(allow: Allow) -> list[str]:
    peers: list[str] = [""] if allow.peers is None else [_peer_match(p) for p in allow.peers]
    ports: list[str] = [""] if allow.ports is None else [_port_match(p) for p in allow.ports]
    return [" ".join(x for x in (peer, port, "accept") if x) for peer in peers for port in ports]


def nft_script(plan: Plan) -> str:
    """The pod netns' whole `cairn_netpol` table: replaced atomically by `nft -f`."""
    lines = [f"table inet {TABLE} {{}}", f"delete table inet {TABLE}"]
    if plan is None:
        return "\n".join(lines) + "\n"
    body = [
        'iifname "lo" accept',
        "ct state established,related accept",
        "ct state invalid drop",
        f"ip saddr {NODE_ADDRESS} accept",
        *(line for allow in plan for line in _rule_lines(allow)),
    ]
    lines += [
        f"table inet {TABLE} {{",
        "  chain ingress {",
        "    type filter hook input priority filter; policy drop;",
        *(f"    {line}" for line in body),
        "  }",
        "}",
    ]
    return "\n".join(lines) + "\n"
