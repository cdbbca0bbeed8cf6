"""The devcluster's API server as its admin: TLS context and a bounded GET.

Shared by ``cluster`` and ``kueue`` (which ``cluster`` imports), so neither
imports the other. ``Target`` is what they need of a devcluster
(``cluster.Cluster`` is one): its state directory and API server URL.
"""

import ssl
import urllib.error
import urllib.request
from typing import Protocol

from cairn.devcluster import paths


class Target(Protocol):
    """A devcluster as seen from its admin: state directory and API server."""

    @property
    def state(self) -> paths.StatePaths: ...

    @property
    def server(self) -> str: ...


def admin_ssl_context(target: Target) -> ssl.SSLContext:
    """TLS to the API server as the admin (the devcluster's own CA and admin cert)."""
    ctx = ssl.create_default_context(cafile=str(target.state.pki / "ca.crt"))
    ctx.load_cert_chain(str(target.state.pki / "admin.crt"), str(target.state.pki / "admin.key"))
    return ctx


def api_get(target: Target, path: str, *, timeout: float = 5.0) -> tuple[int, bytes]:
    """GET a path of the API server as the admin; (status, body), status 0 if unreachable."""
    request = urllib.request.Request(target.server + path)
    try:
        with urllib.request.urlopen(
            request, timeout=timeout, context=admin_ssl_context(target)
        ) as resp:
            return int(resp.status), bytes(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError):
        return 0, b""
