"""Exit codes and the termination message: how a trainer tells the operator why it stopped.

Pure. The trainer image exits with one of these codes; the operator reads
the code and the container's termination message (the file at
``TERMINATION_MESSAGE_PATH``, which the kubelet copies into
``status.containerStatuses[].state.terminated.message``) to decide what the
job does next. Both sides import this module, so the contract cannot drift.

| code | meaning | what the operator does |
| --- | --- | --- |
| 0 | all steps done, final checkpoint committed | Succeeded |
| 78 | configuration error: deterministic, a restart cannot fix it | Failed at once, reason from the message, no restart spent |
| other, message `ConfigurationError: …` | the same, through torchrun (which exits 1 for a failed worker) | as 78 |
| 143 | preempted (SIGTERM), final checkpoint committed | restart, not counted |
| other | a failure | `restartPolicy` decides |
"""

SUCCESS = 0
CONFIG_ERROR = 78
"""sysexits.h EX_CONFIG: the job as written cannot run (unloadable resume
target, unreadable checkpoint format, bad option). Never retried."""
PREEMPTED = 143
"""128 + SIGTERM: the pod was asked to stop and committed its final checkpoint."""

TERMINATION_MESSAGE_PATH = "/dev/termination-log"
"""Kubernetes' default ``terminationMessagePath``; the operator sets it explicitly."""
TERMINATION_MESSAGE_MAX_BYTES = 4096
"""The kubelet keeps at most 4096 bytes of the message; the trainer writes no more."""
CONFIG_ERROR_REASON = "ConfigurationError"
"""The job's ``Failed`` condition reason when a rank exits with ``CONFIG_ERROR``."""


FOLLOWS_HEAD_REASON = "FollowsHead"
"""Runtime ray: a worker pod that stopped because the head announced a failed
driver writes ``FollowsHead: …`` as its termination message; the operator
takes the head's failure as the attempt's root cause, not the worker's."""


def follows_head(termination_message: str) -> bool:
    """Whether a Ray worker's failure only echoes the head's (see FOLLOWS_HEAD_REASON)."""
    return termination_message.lstrip().startswith(f"{FOLLOWS_HEAD_REASON}:")


def is_config_error(exit_code: int | None, termination_message: str) -> bool:
    """Whether a terminated trainer container reported a configuration error. Pure.

    Exit code 78, or any failure whose termination message the trainer wrote
    as ``ConfigurationError: …``: torchrun exits 1 when a worker fails, so
    under torchrun the message is the only signal that survives.
    """
    if exit_code == CONFIG_ERROR:
        return True
    return bool(exit_code) and termination_message.lstrip().startswith(f"{CONFIG_ERROR_REASON}:")
