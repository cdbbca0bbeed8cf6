"""Kueue for the devcluster's own tests.

`kueue_cluster` (session): Kueue running on the devcluster, started on demand
(bounded: `kueue.up` builds if missing and waits at most 180 s for its
webhooks). It is left running: it is shared with other test sessions (the
operator's Kueue e2e tests) like the cluster itself, and `devcluster down`,
including the `devcluster` fixture's when it started the cluster, stops it.
"""

from typing import Any

import pytest

from cairn.devcluster import cluster, kueue


@pytest.fixture(scope="session")
def kueue_cluster(devcluster: Any) -> cluster.Cluster:
    devcluster.require_devcluster()
    target: cluster.Cluster = devcluster.target
    kueue.up(target)
    return target
