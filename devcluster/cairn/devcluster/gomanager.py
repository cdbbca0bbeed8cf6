"""A controller manager built from its Go module and run beside the devcluster
as a process of its own (Kueue, and JobSet for the scale bench): the lifecycle
pieces both share.

Each manager serves its admission webhooks on 127.0.0.1 with a certificate
from the cluster's CA and a readiness probe on a port of its own; these
helpers check the ports, write the serving pair where the manager reads it,
wait for its CRDs to be Established and for the manager to answer, always
against a deadline and with the manager's log named in the error.
"""

import json
import pathlib
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence

from cairn.devcluster import adminapi, errors, pki, processes

Target = adminapi.Target

ESTABLISH_SECONDS = 60.0


def running(target: Target, component: str) -> bool:
    """Whether the manager's pidfile names a live process."""
    tracked = processes.read_pidfile(target.state.pidfile(component))
    return tracked is not None and processes.is_alive(tracked)


def ready_probe(port: int) -> bool:
    """The manager's own `/readyz` on 127.0.0.1:`port` answers 200."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def refuse_busy_ports(ports: Iterable[int], *, who: str) -> None:
    """Refuse to start when a port the manager needs is taken (named in the error)."""
    busy = [p for p in ports if not port_free(p)]
    if busy:
        raise errors.DevclusterError(
            f"port(s) {', '.join(map(str, busy))} on 127.0.0.1 already in use: {who}'s "
            f"webhook/probes need them; stop whatever holds them"
        )


def copy_private(src: pathlib.Path, dst: pathlib.Path) -> None:
    dst.write_bytes(src.read_bytes())
    dst.chmod(0o600)


def serving_certs(
    target: Target, *, stem: str, common_name: str, cert_dir: pathlib.Path
) -> pathlib.Path:
    """The webhook's serving pair from the cluster's CA, as `tls.crt`/`tls.key`
    in `cert_dir` (where the manager reads it)."""
    pki.ensure_serving(
        target.state.pki, stem=stem, common_name=common_name, ips=("127.0.0.1",), dns=("localhost",)
    )
    cert_dir.mkdir(parents=True, exist_ok=True)
    for src, dst in ((".crt", "tls.crt"), (".key", "tls.key")):
        copy_private(target.state.pki / f"{stem}{src}", cert_dir / dst)
    return cert_dir


def crd_established(target: Target, name: str) -> bool:
    """Whether the CRD `name` exists and is Established."""
    status, raw = adminapi.api_get(
        target, f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"
    )
    if status != 200:
        return False
    try:
        body = json.loads(raw)
    except ValueError:
        return False
    # A CRD created a moment ago has `status.conditions: null`.
    conditions = (body.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)


def wait_established(
    target: Target, names: Sequence[str], *, failure: Callable[[list[str]], str]
) -> None:
    """Until every CRD in `names` is Established, at most ESTABLISH_SECONDS;
    else DevclusterError(`failure(pending)`)."""
    deadline = time.monotonic() + ESTABLISH_SECONDS
    pending = set(names)
    while pending and time.monotonic() < deadline:
        for name in sorted(pending):
            if crd_established(target, name):
                pending.discard(name)
        time.sleep(0.2 if pending else 0)
    if pending:
        raise errors.DevclusterError(failure(sorted(pending)))


def wait_ready(
    target: Target,
    *,
    component: str,
    ready: Callable[[], bool],
    deadline: float,
    exited: str,
    timed_out: str,
) -> None:
    """Until `ready()`, the manager alive, before `deadline`; the errors name its log."""
    log = target.state.log(component)
    while time.monotonic() < deadline:
        if not running(target, component):
            raise errors.DevclusterError(f"{exited}; see {log}")
        if ready():
            return
        time.sleep(0.25)
    raise errors.DevclusterError(f"{timed_out}; see {log}")
