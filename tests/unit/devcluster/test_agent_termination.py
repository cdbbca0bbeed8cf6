"""The node agent's termination messages (pure parts; the devcluster test is
tests/integration/operator/test_visible_failures.py::test_config_error_fails_at_once_with_the_message).

Covers: the message file is mounted at the container's terminationMessagePath
(the default /dev/termination-log when unset); what the program wrote wins,
capped at 4096 bytes; FallbackToLogsOnError uses the log tail (80 lines,
2 KiB) only for a non-zero exit with an empty file; policy File never does.
"""

from typing import Any

from cairn.devcluster.agent import podspec, podstatus

POD: dict[str, Any] = {
    "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
    "spec": {"nodeName": "n"},
}


def _plan(container: dict[str, Any]) -> podspec.ContainerPlan:
    return podspec.plan_container(
        pod=POD,
        container=container,
        pod_ip="10.244.1.2",
        host_ip="127.0.0.1",
        hostname="p",
        secrets={},
        config_maps={},
        volume_dirs={},
        base_env={},
        termination_file="/state/pods/p/termination/trainer-0",
    )


def test_message_file_is_mounted_at_the_termination_path() -> None:
    plan = _plan({"name": "trainer", "command": ["true"], "terminationMessagePath": "/run/why"})
    assert plan.mounts[-1] == podspec.Mount(
        source="/state/pods/p/termination/trainer-0", target="/run/why", read_only=False
    )
    default = _plan({"name": "trainer", "command": ["true"]})
    assert default.mounts[-1].target == "/dev/termination-log"


def test_written_message_wins_and_is_capped() -> None:
    written = b"x" * 5000
    got = podstatus.termination_message(
        written=written, log_tail=b"log", policy="FallbackToLogsOnError", exit_code=78
    )
    assert got == "x" * 4096


def test_fallback_to_logs_only_on_error() -> None:
    log = b"".join(f"line {i}\n".encode() for i in range(200))
    got = podstatus.termination_message(
        written=b"", log_tail=log, policy="FallbackToLogsOnError", exit_code=1
    )
    assert got.endswith("line 199\n") and got.count("\n") <= 80 and len(got) <= 2048
    assert (
        podstatus.termination_message(
            written=b"", log_tail=log, policy="FallbackToLogsOnError", exit_code=0
        )
        == ""
    )
    assert (
        podstatus.termination_message(written=b"  \n", log_tail=log, policy="File", exit_code=1)
        == ""
    )
