"""The tests' Ray cluster lives in testbed/launchers/ray_cluster.py (the two-node benchmark uses it too)."""
from testbed.launchers.ray_cluster import RayCluster, free_port  # noqa: F401
