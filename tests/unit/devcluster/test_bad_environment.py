"""Bad local environments give one clear line, never a hang or a traceback.

Covers: a port already in use, a state dir from another Kubernetes version,
a missing Go toolchain, and the CLI turning each into exit code 2.
"""

import dataclasses
import json
import pathlib
import socket

import pytest

from cairn.devcluster import build, cli, cluster, controlplane, errors, paths


def _cluster(tmp_path: pathlib.Path, **ports: int) -> cluster.Cluster:
    return cluster.Cluster(
        state=paths.StatePaths(root=tmp_path / "state"), ports=controlplane.Ports(**ports)
    )


def test_port_in_use_is_named(tmp_path: pathlib.Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        target = _cluster(tmp_path, apiserver=port)
        with pytest.raises(
            errors.DevclusterError, match=rf"port\(s\) (.*, )?{port}(, .*)? already in use"
        ):
            cluster._check_ports(target)


def test_state_dir_of_other_version_is_refused(tmp_path: pathlib.Path) -> None:
    target = _cluster(tmp_path)
    target.state.root.mkdir(parents=True)
    target.state.info_file.write_text(json.dumps({"kubernetes": "v1.20.0"}))
    with pytest.raises(errors.DevclusterError, match="devcluster down --purge"):
        cluster._check_not_stale(target)


def test_missing_go_is_explained(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path / "cache"))
    uncached = dataclasses.replace(build.ETCD, version="v0.0.0-test")
    with pytest.raises(errors.DevclusterError, match="Go is not on PATH"):
        build.build(uncached, log=tmp_path / "build.log")


def test_cli_prints_one_line_and_exits_2(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "cluster.json").write_text(json.dumps({"kubernetes": "v1.20.0"}))
    monkeypatch.setenv(paths.STATE_ENV, str(state))
    assert cli.main(["up"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("devcluster: error:")
