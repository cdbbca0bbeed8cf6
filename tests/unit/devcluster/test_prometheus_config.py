"""cairn.devcluster.prometheus without a Prometheus: its configuration and a missing binary.

Covers: the configuration scrapes exactly the given targets every second and
loads exactly the given rule files; no ``prometheus`` on PATH is a
``DevclusterError`` that says how to install it (not a FileNotFoundError
from deep inside ``spawn``).
"""

import pathlib

import pytest

from cairn.devcluster import errors, prometheus


def test_config_scrapes_the_targets_and_loads_the_rules() -> None:
    got = prometheus.config(targets=["127.0.0.1:9090"], rule_files=[pathlib.Path("/r.yaml")])
    assert got["rule_files"] == ["/r.yaml"]
    assert got["scrape_configs"] == [
        {"job_name": "cairn-operator", "static_configs": [{"targets": ["127.0.0.1:9090"]}]}
    ]
    assert got["global"] == {"scrape_interval": "1s", "evaluation_interval": "1s"}


def test_missing_binary_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(errors.DevclusterError, match="apt-get install prometheus"):
        prometheus.binary()
