"""The in-memory tier in a rank's pod (`spec.checkpoint.memory`), pure builders.

Covers: enabled → a `medium: Memory` emptyDir sized by `sizeLimit`, mounted
at `podenv.MEMORY_MOUNT_PATH` in the trainer container, with
`CAIRN_MEMORY_DIR` and `CAIRN_MEMORY_REPLICAS` in its env; disabled (the
default) → none of the three; the model refuses `enabled` without a size and
a size that does not fit under the container's memory limit.
"""

from typing import Any

import pydantic
import pytest

from cairn.api import checkpointspec, podenv, trainingjob
from cairn.operator.core import builders

from . import jobs

MEMORY = {"enabled": True, "sizeLimit": "2Gi", "replicas": 1}


def _pod(**spec: Any) -> dict[str, Any]:
    job = jobs.job(**spec)
    got = builders.pod(job, attempt=1, rank=1, resume=podenv.ResumeTarget(kind="latest"))
    return dict(got)


def _env(pod: dict[str, Any]) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def test_enabled_mounts_a_sized_memory_volume_and_says_where() -> None:
    pod = _pod(checkpoint={"memory": MEMORY})
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes[podenv.MEMORY_VOLUME_NAME] == {
        "name": podenv.MEMORY_VOLUME_NAME,
        "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"},
    }
    mounts = pod["spec"]["containers"][0]["volumeMounts"]
    assert {"name": podenv.MEMORY_VOLUME_NAME, "mountPath": podenv.MEMORY_MOUNT_PATH} in mounts
    env = _env(pod)
    assert env[podenv.MEMORY_DIR] == podenv.MEMORY_MOUNT_PATH
    assert env[podenv.MEMORY_REPLICAS] == "1"


def test_replicas_zero_is_passed_on() -> None:
    pod = _pod(checkpoint={"memory": {**MEMORY, "replicas": 0}})
    assert _env(pod)[podenv.MEMORY_REPLICAS] == "0"


def test_disabled_by_default_adds_nothing() -> None:
    pod = _pod()
    assert podenv.MEMORY_VOLUME_NAME not in {v["name"] for v in pod["spec"]["volumes"]}
    mounts = pod["spec"]["containers"][0]["volumeMounts"]
    assert all(m["name"] != podenv.MEMORY_VOLUME_NAME for m in mounts)
    env = _env(pod)
    assert podenv.MEMORY_DIR not in env and podenv.MEMORY_REPLICAS not in env


def test_enabled_without_a_size_is_refused() -> None:
    with pytest.raises(pydantic.ValidationError, match="sizeLimit is required"):
        jobs.job(checkpoint={"memory": {"enabled": True}})


@pytest.mark.parametrize(
    ("size", "limit", "fits"),
    [("1Gi", "2Gi", True), ("2Gi", "2Gi", False), ("3G", "2Gi", False), ("1500Mi", "2G", True)],
)
def test_size_must_fit_under_the_memory_limit(size: str, limit: str, fits: bool) -> None:
    spec: dict[str, Any] = {
        "resources": {"limits": {"memory": limit}},
        "checkpoint": {"memory": {"enabled": True, "sizeLimit": size}},
    }
    if fits:
        jobs.job(**spec)
        return
    with pytest.raises(pydantic.ValidationError, match=r"less than resources\.limits\.memory"):
        jobs.job(**spec)


@pytest.mark.parametrize(
    ("text", "value"),
    [("1Gi", 2**30), ("1G", 1e9), ("500m", 0.5), ("1e3", 1000.0), (7, 7.0), ("1.5Ki", 1536.0)],
)
def test_quantity_value(text: str | int, value: float) -> None:
    assert checkpointspec.quantity_value(text) == value


def test_every_volume_the_operator_adds_is_reserved_in_the_overlay() -> None:
    """A user volume named like one of the operator's would fail every pod's creation."""
    reserved = {
        trainingjob.CHECKPOINT_VOLUME_NAME,
        trainingjob.RAY_VOLUME_NAME,
        *trainingjob.OWNED_VOLUME_NAMES,
    }
    owned = {
        podenv.MEMORY_VOLUME_NAME,
        builders.MANIFEST_KEY_VOLUME,
        builders.RAY_TOKEN_VOLUME,
        builders.RAY_VOLUME_NAME,
    }
    assert owned <= reserved
