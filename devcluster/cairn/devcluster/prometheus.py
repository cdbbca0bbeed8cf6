"""A real Prometheus (the Debian package's binary) scraping the operator on the devcluster.

Used by tests and by hand: ``start`` writes a configuration that scrapes the
given ``/metrics`` targets every second and loads the given rule files,
starts ``prometheus`` as a tracked process (pidfile under the devcluster's
state), and waits, with a deadline, until it is ready and has loaded its
rules. ``query`` and ``rules`` read its HTTP API. The binary comes from the
Debian package ``prometheus`` (``scripts/bootstrap`` installs it); it is never
put into the virtualenv. A missing binary is a ``DevclusterError`` saying so.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

from cairn.devcluster import errors, processes

NAME = "prometheus"
READY_SECONDS = 60.0
INSTALL_HINT = "apt-get install prometheus (scripts/bootstrap does it)"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Server:
    """A running Prometheus: its API address and its tracked process."""

    url: str
    pidfile: pathlib.Path
    log: pathlib.Path

    def stop(self) -> None:
        processes.stop_pidfile(self.pidfile, grace_seconds=10.0)

    def api(self, path: str, **params: str) -> Any:
        """``GET /api/v1/<path>``'s ``data``; raises with Prometheus's own error text."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as got:
                body = json.load(got)
        except urllib.error.HTTPError as error:
            body = json.loads(error.read() or b"{}")
        if body.get("status") != "success":
            raise errors.DevclusterError(f"prometheus {path}: {body.get('error', body)}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's series (a vector result's entries)."""
        data = self.api("query", query=expr)
        result: list[dict[str, Any]] = data["result"]
        return result

    def rules(self) -> list[dict[str, Any]]:
        """Every loaded rule with its ``health`` and ``lastError``."""
        return [rule for group in self.api("rules")["groups"] for rule in group["rules"]]


def binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        raise errors.DevclusterError(f"no prometheus binary on PATH: {INSTALL_HINT}")
    return found


def config(*, targets: Sequence[str], rule_files: Sequence[pathlib.Path]) -> dict[str, Any]:
    """The configuration: 1 s scrapes and rule evaluations (tests wait on them). Pure."""
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        # Absolute: Prometheus reads relative rule paths from the config file's folder.
        "rule_files": [str(path.resolve()) for path in rule_files],
        "scrape_configs": [
            {"job_name": "cairn-operator", "static_configs": [{"targets": list(targets)}]}
        ],
    }


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def start(
    *,
    workdir: pathlib.Path,
    targets: Sequence[str],
    rule_files: Sequence[pathlib.Path],
    pidfile: pathlib.Path,
) -> Server:
    """Start Prometheus with its data under ``workdir``; ready and rules loaded, or raises."""
    workdir.mkdir(parents=True, exist_ok=True)
    settings = workdir / "prometheus.yml"
    # JSON is YAML: no YAML writer needed.
    settings.write_text(json.dumps(config(targets=targets, rule_files=rule_files)))
    port = _free_port()
    server = Server(url=f"http://127.0.0.1:{port}", pidfile=pidfile, log=workdir / "prometheus.log")
    processes.spawn(
        name=NAME,
        argv=[
            binary(),
            f"--config.file={settings}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        log_path=server.log,
        pidfile=pidfile,
    )
    try:
        _wait_ready(server, rules=len(rule_files) > 0)
    except BaseException:
        server.stop()
        raise
    return server


def _wait_ready(server: Server, *, rules: bool) -> None:
    deadline = time.monotonic() + READY_SECONDS
    last = "no answer"
    while time.monotonic() < deadline:
        tracked = processes.read_pidfile(server.pidfile)
        if tracked is None or not processes.is_alive(tracked):
            tail = server.log.read_text(errors="replace")[-2000:] if server.log.exists() else ""
            raise errors.DevclusterError(f"prometheus exited while starting: {tail}")
        try:
            with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2):
                pass
            if not rules or server.rules():
                return
            last = "ready, no rules loaded yet"
        except (OSError, errors.DevclusterError) as error:
            last = str(error)
        time.sleep(0.2)
    raise errors.DevclusterError(f"prometheus not ready within {READY_SECONDS:.0f} s: {last}")
