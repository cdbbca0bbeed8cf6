"""The Ray head of this test session (real, on loopback, started and stopped by PID)."""

from collections.abc import Iterator

import pytest

from tests.integration.ray import rayhead


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[rayhead.RayHead]:
    head = rayhead.start(tmp_path_factory.mktemp("ray-head"), num_cpus=4)
    try:
        yield head
    finally:
        head.stop()
