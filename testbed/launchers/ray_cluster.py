"""A Ray cluster a test or a benchmark owns: `ray start --head --block` (and
worker nodes) as child process groups, optionally inside a network namespace
(netns_nodes.py), bound to the address given (loopback or a namespace's),
dashboard off, CPUs and object store limited, a temporary directory of its own. `stop()` kills exactly its own process groups
and whatever still names its temporary directory, never `ray stop` (which
would stop every Ray on the machine)."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from testbed.launchers.netns_nodes import sigkill

RAY = str(Path(sys.executable).with_name("ray"))


def free_port(host: str = "") -> int:
    """A port free on `host` ("": any port number, for a fresh namespace where all are free)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RayCluster:
    def __init__(self, host: str = "127.0.0.1", num_cpus: int = 3, resources: dict | None = None,
                 netns: str | None = None, port: int | None = None, object_store_bytes: int = 256 << 20,
                 cpus: str = ""):
        self.host, self.netns, self.object_store_bytes = host, netns, object_store_bytes
        self.port = port or free_port("" if netns else host)
        self.address = f"{host}:{self.port}"
        self.temp_dir = tempfile.mkdtemp(prefix="rt17-")      # short: unix socket paths are bounded
        # Ray's token authentication with a token of this cluster's own (never ~/.ray/auth_token);
        # every process that joins it (a driver, `testbed run`) needs `env`
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
                    "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        self._procs: list[subprocess.Popen] = []
        self._start(["--head", f"--port={self.port}", "--include-dashboard=false"], host, num_cpus, resources, netns,
                    cpus)

    def _start(self, role_args: list[str], host: str, num_cpus: int, resources: dict | None, netns: str | None,
               cpus: str = ""):
        """cpus: the node's processes (raylet, its workers, the actors) run on these CPUs only
        (taskset -c; "": any)."""
        cmd = [RAY, "start", "--block", *role_args, f"--node-ip-address={host}", f"--num-cpus={num_cpus}",
               "--num-gpus=0", "--disable-usage-stats", f"--temp-dir={self.temp_dir}",
               f"--object-store-memory={self.object_store_bytes}"]
        if resources:
            cmd.append(f"--resources={json.dumps(resources)}")
        if cpus:
            cmd = ["taskset", "-c", cpus, *cmd]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        log = open(Path(self.temp_dir) / f"start-{len(self._procs)}.log", "w")
        self._procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True))

    def add_node(self, host: str, num_cpus: int = 2, resources: dict | None = None, netns: str | None = None,
                 cpus: str = ""):
        self._start([f"--address={self.address}"], host, num_cpus, resources, netns, cpus)
        return self._procs[-1]

    def wait_nodes(self, n: int, timeout_s: float = 120) -> None:
        """Until n nodes are alive (checked from a subprocess: this process keeps no Ray state)."""
        probe = ("import ray,sys; ray.init(address=sys.argv[1], configure_logging=False, log_to_driver=False);"
                 "print(sum(x['Alive'] for x in ray.nodes()))")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for p in self._procs:
                if p.poll() is not None:
                    raise RuntimeError(f"ray start exited ({p.returncode}): {self.logs()}")
            cmd = [sys.executable, "-c", probe, self.address]
            r = subprocess.run(["ip", "netns", "exec", self.netns, *cmd] if self.netns else cmd,
                               capture_output=True, text=True, timeout=timeout_s, env=self.env)
            if r.returncode == 0 and r.stdout.strip().splitlines()[-1:] == [str(n)]:
                return
            time.sleep(1)
        raise TimeoutError(f"ray: {n} nodes not up after {timeout_s} s: {self.logs()}")

    def logs(self) -> str:
        return "\n".join(p.read_text()[-2000:] for p in Path(self.temp_dir).glob("start-*.log"))

    def kill_node(self, index: int) -> None:
        """Kill node `index`'s process group (`ray start` and its raylet and daemons). Ray's
        worker processes (the actors) are not in it: to kill a whole node, kill every process
        of its namespace (NetnsNodes.kill)."""
        _killpg(self._procs[index], signal.SIGKILL)

    def node_pgid(self, index: int) -> int:
        """Node `index`'s process group (its `ray start`, raylet and all they started)."""
        return self._procs[index].pid

    def own_pids(self) -> list[int]:
        """Processes that still name this cluster's temporary directory."""
        out = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if self.temp_dir.encode() in Path("/proc", entry, "cmdline").read_bytes():
                        out.append(int(entry))
                except OSError:
                    pass
        return out

    def stop(self) -> None:
        for p in self._procs:
            _killpg(p, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in self._procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _killpg(p, signal.SIGKILL)
        for _ in range(50):
            left = self.own_pids()
            if not left:
                break
            sigkill(left)
            time.sleep(0.1)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _killpg(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
