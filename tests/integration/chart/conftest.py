"""Fixtures for the chart's tests: the pinned helm binary."""

import pathlib

import pytest

from . import helmtools


@pytest.fixture(scope="session")
def helm() -> pathlib.Path:
    return helmtools.install_helm()
