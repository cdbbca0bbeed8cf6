"""The thin effect of ``egressplan``: resolve a job's S3 endpoint, with a deadline.

Blocking: ``prefixapply.open_prefix`` calls ``refusal`` from an S3 worker
thread, never from the event loop. The lookup itself runs in this module's
own small pool and is waited for at most ``RESOLVE_SECONDS``: a resolver that
hangs costs one pass that deadline and the job a (generic, retried next pass)
refusal, never a stuck S3 thread. The detail (the address, the resolver's
error) goes to the operator log only.

Residual risk (docs/security.md): boto3 resolves the name again when it
connects, so a name whose DNS answer changes between the two lookups
(rebinding) is caught only when the second answer is refused too. An admin
who needs certainty lists the store in ``s3.endpointAllowList``, which then
refuses every other endpoint.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import socket
import urllib.parse

from cairn.api import checkpointspec
from cairn.operator.core import egressplan, prefixplan

LOG = logging.getLogger(__name__)
RESOLVE_SECONDS = 5.0
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="cairn-resolve")


@functools.cache
def _networks(texts: tuple[str, ...]) -> tuple[egressplan.Network, ...]:
    return egressplan.parse_networks(texts, what=prefixplan.ENV_CLUSTER_NETWORKS)


def _lookup(host: str, port: int) -> tuple[str, ...]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return tuple(dict.fromkeys(str(info[4][0]) for info in infos))


def resolve(host: str, port: int, *, deadline: float = RESOLVE_SECONDS) -> tuple[str, ...]:
    """Every address of ``host``; OSError, or TimeoutError past ``deadline`` seconds."""
    return _POOL.submit(_lookup, host, port).result(timeout=deadline)


def _addresses(endpoint: str, *, deadline: float) -> tuple[str, tuple[str, ...]] | str:
    """(host, addresses), or the reason there are none (for the log)."""
    try:
        parts = urllib.parse.urlsplit(endpoint.strip())
        host = parts.hostname
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as error:
        return f"{endpoint!r} is not a URL ({error})"
    if not host:
        return f"{endpoint!r} names no host"
    try:
        return host, resolve(host, port, deadline=deadline)
    except TimeoutError:
        return f"resolving {host} took longer than {deadline:g} s"
    except (OSError, UnicodeError) as error:
        return f"resolving {host}: {error}"


def refusal(
    upload: checkpointspec.UploadSpec,
    settings: prefixplan.Settings,
    *,
    job: str,
    deadline: float = RESOLVE_SECONDS,
) -> prefixplan.Claim | None:
    """Why the operator must not call the job's endpoint (a generic claim), or None.

    An allow-listed endpoint and the SDK's default endpoint (none named) pass
    unresolved. ``job`` (namespace/name) is for the log line only.
    """
    if upload.endpoint is None or prefixplan.allow_listed(upload.endpoint, settings):
        return None
    found = _addresses(upload.endpoint, deadline=deadline)
    if isinstance(found, str):
        verdict: egressplan.Refusal | None = egressplan.refused(found)
    else:
        host, addresses = found
        cluster = _networks(settings.cluster_networks)
        verdict = egressplan.refusal(host=host, addresses=addresses, cluster=cluster)
    if verdict is None:
        return None
    LOG.warning("S3 endpoint of %s refused: %s", job, verdict.detail)
    return verdict.claim
