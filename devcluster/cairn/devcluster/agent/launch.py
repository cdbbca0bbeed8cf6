"""Runs inside a pod's namespaces: mount the volumes, set the hostname, exec.

The worker starts `ip netns exec <ns> unshare --uts --mount --propagation
private python -m cairn.devcluster.agent.launch <plan.json>`: this process
is then in the pod's network namespace and in fresh UTS and mount namespaces
of its own, so the bind mounts it makes (each volume directory onto its
`mountPath`, read-only where asked) are seen by the container alone, and
unmodified programs find their files at the paths the pod spec names. It
then `exec`s the container's command, keeping its PID, so signals from the
worker reach the program itself.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys


def _bind(source: str, target: str, *, read_only: bool) -> None:
    src = pathlib.Path(source)
    dst = pathlib.Path(target)
    if src.is_dir():
        dst.mkdir(parents=True, exist_ok=True)
    else:
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.touch(exist_ok=True)
    subprocess.run(["mount", "--bind", source, target], check=True)
    if read_only:
        subprocess.run(["mount", "-o", "remount,bind,ro", target], check=True)


def main(argv: list[str]) -> int:
    plan = json.loads(pathlib.Path(argv[1]).read_text())
    socket.sethostname(plan["hostname"])
    for mount in plan["mounts"]:
        _bind(mount["source"], mount["target"], read_only=mount["read_only"])
    if plan.get("working_dir"):
        pathlib.Path(plan["working_dir"]).mkdir(parents=True, exist_ok=True)
        os.chdir(plan["working_dir"])
    command = plan["argv"]
    try:
        os.execvpe(command[0], command, plan["env"])
    except OSError as exc:
        print(f"devcluster: cannot run {command[0]!r}: {exc}", file=sys.stderr, flush=True)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv))
