"""A local Ray cluster of two nodes (a head and a worker, each a raylet process on this machine, one CPU each),
shared by the Ray Data and Ray Serve tests."""

from __future__ import annotations

import pytest
import ray
import ray.data


@pytest.fixture(scope="package")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    c.add_node(num_cpus=1)
    ray.init(address=c.address, logging_level="ERROR")
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield c
    ray.shutdown()
    c.shutdown()
