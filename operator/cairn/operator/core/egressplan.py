"""Which addresses the operator may send a job's S3 requests to. Pure.

A user names ``upload.endpoint``; the operator then GETs, PUTs and DELETEs
there with the job's credentials (verification, retention, the prefix claim,
``onDelete``). Without a rule, that is a request forgery primitive aimed at
the operator's own network position: its loopback (metrics, health), the
node's link-local services (cloud metadata at 169.254.169.254), the
cluster's Services and pods. So an endpoint whose host is, or resolves to,
an address in those ranges is refused unless the endpoint is listed in
``prefixplan.Settings.endpoint_allow_list`` (the devcluster's S3 on
loopback/the pod gateway is, explicitly).

``egress`` (IO, a worker thread) resolves the host with a deadline and
calls ``refusal`` with the addresses it got; this module never resolves.
The refusal is a generic ``prefixplan.Claim`` for the job's status (no
address, no resolver error: the status is readable by the user who chose
the name) and a detail string for the operator log only.
"""

import dataclasses
import ipaddress
from collections.abc import Iterable, Sequence

from cairn.operator.core import prefixplan

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

ALWAYS_REFUSED: tuple[tuple[str, str], ...] = (
    ("127.0.0.0/8", "loopback"),
    ("::1/128", "loopback"),
    ("0.0.0.0/8", "this host"),  # connect() to 0.0.0.0 reaches the local host
    ("::/128", "this host"),
    ("169.254.0.0/16", "link-local"),
    ("fe80::/10", "link-local"),
)
"""Refused whatever the cluster: the operator's own host and the node's
link-local services (cloud instance metadata)."""

REFUSED_MESSAGE = (
    "upload.endpoint is on a network the operator does not call for a job "
    "(loopback, link-local, or the cluster's own Service/pod ranges), or its "
    "host could not be resolved in time; no S3 call made. If this store is "
    "intended, a cluster admin lists its endpoint in s3.endpointAllowList"
)
"""Generic on purpose: never the resolved address nor the resolver's error."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Refusal:
    """A refused endpoint: the claim for the status, the detail for the log."""

    claim: prefixplan.Claim
    detail: str


def parse_networks(texts: Iterable[str], *, what: str) -> tuple[Network, ...]:
    """CIDRs as networks; ValueError naming ``what`` (the setting) on a bad one."""
    found: list[Network] = []
    for text in texts:
        try:
            found.append(ipaddress.ip_network(text.strip(), strict=False))
        except ValueError as error:
            raise ValueError(f"{what}: {text.strip()!r} is not a CIDR ({error})") from None
    return tuple(found)


_ALWAYS = tuple((ipaddress.ip_network(cidr), label) for cidr, label in ALWAYS_REFUSED)


def _address(text: str) -> Address | None:
    try:
        found = ipaddress.ip_address(text.split("%", 1)[0])  # drop an IPv6 zone index
    except ValueError:
        return None
    if isinstance(found, ipaddress.IPv6Address) and found.ipv4_mapped is not None:
        return found.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    return found


def classify(text: str, *, cluster: Sequence[Network]) -> str | None:
    """Why the operator must not connect to address ``text`` (a label), or None."""
    found = _address(text)
    if found is None:
        return "not an IP address"
    for network, label in _ALWAYS:
        if found.version == network.version and found in network:
            return label
    for network in cluster:
        if found.version == network.version and found in network:
            return f"cluster network {network}"
    return None


def refused(detail: str) -> Refusal:
    claim = prefixplan.Claim(owned=False, reason=prefixplan.REASON_ADDRESS, message=REFUSED_MESSAGE)
    return Refusal(claim=claim, detail=detail)


def refusal(*, host: str, addresses: Sequence[str], cluster: Sequence[Network]) -> Refusal | None:
    """Refused when any address the host resolved to is refused (a name with one
    public and one loopback address could be answered either way), or when it
    resolved to nothing. Pure."""
    if not addresses:
        return refused(f"{host} resolved to no address")
    for text in addresses:
        label = classify(text, cluster=cluster)
        if label is not None:
            return refused(f"{host} resolves to {text} ({label})")
    return None
