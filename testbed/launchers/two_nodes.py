"""Two "hosts" on one machine running one Ray cluster: node A (a network
namespace, the Ray head, custom resource `node_a`) and node B (a Ray worker
node, `node_b`), joined by a veth pair (netns_nodes.py). The frontend
(`testbed run`) runs inside node A with `run_args()`: prefill pinned to
node A, decode to node B, every socket bound on the nodes' veth addresses and
so under the run's CURVE keys, the KV crossing the veth.

    with TwoNodes() as tn:
        subprocess.run(tn.frontend(python, "-m", "testbed.cli", "run", "mode=disagg", *tn.run_args()),
                       env=tn.env)

`close` (context exit, or at exit) stops Ray (RayCluster.stop: its own
process groups only) and then kills whatever is left in the namespaces and
deletes them."""
from __future__ import annotations

import atexit

from testbed.launchers.netns_nodes import NetnsNodes
from testbed.launchers.ray_cluster import RayCluster

NODE_RESOURCE = 8              # units of `node_a` / `node_b` each node offers; a pool's bundle asks 0.001


class TwoNodes:
    def __init__(self, cpus_a: int = 2, cpus_b: int = 2, mtu: int = 9000, start_timeout_s: float = 180,
                 split_cpus: bool = False) -> None:
        """split_cpus: each node's processes on CPUs of its own (NetnsNodes), as two hosts."""
        self.net = NetnsNodes(2, mtu=mtu, split_cpus=split_cpus)
        self.ray: RayCluster | None = None
        atexit.register(self.close)
        try:
            self.a, self.b = self.net.nodes
            self.ray = RayCluster(host=self.a.address, num_cpus=cpus_a, resources={"node_a": NODE_RESOURCE},
                                  netns=self.a.netns, cpus=self.a.cpus)
            self.ray.add_node(self.b.address, num_cpus=cpus_b, resources={"node_b": NODE_RESOURCE},
                              netns=self.b.netns, cpus=self.b.cpus)
            self.ray.wait_nodes(2, timeout_s=start_timeout_s)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "TwoNodes":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def env(self) -> dict[str, str]:
        """The environment a process joining the cluster needs (its Ray token)."""
        return self.ray.env

    def frontend(self, *cmd: str) -> list[str]:
        """`cmd` run on node A (where the frontend must run: it binds node A's address)."""
        return self.a.exec(*cmd)

    def run_args(self) -> list[str]:
        """`testbed run` overrides: join this cluster, prefill on A, decode on B, CURVE on."""
        return ["launcher=ray", f"ray.address={self.ray.address}", "+ray.resources.prefill=node_a",
                "+ray.resources.decode=node_b", f"runtime.host={self.a.address}", "runtime.curve=true",
                f"transfer.host={self.a.address}"]

    def kill_node_b(self) -> list[int]:
        """Node B dies: SIGKILL every process in its namespace (its raylet's process group
        alone is not enough: Ray's worker processes, the actors, are not in it)."""
        return self.net.kill(self.b)

    def close(self) -> None:
        atexit.unregister(self.close)
        if self.ray is not None:
            self.ray.stop()
            self.ray = None
        self.net.close()
