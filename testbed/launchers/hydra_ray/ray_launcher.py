"""`hydra/launcher=ray`: the points of a sweep (`testbed run -m ...`) run as
Ray tasks, in parallel, each in a Ray worker process; a point that fails is
recorded by testbed's task function (its `failed.json`) as under every
launcher, and the others go on.

    testbed run -m hydra/launcher=ray runtime=sim workload.rate=5,10,20
    testbed run -m hydra/launcher=ray hydra.launcher.address=auto ...   # join a running cluster

With no `address`, a local cluster starts for the sweep and stops after it,
inside a private, loopback-only network namespace (testbed/launchers/netns.py)
entered before Ray starts: Ray 2.60 listens on every interface otherwise.

Why not Hydra's hydra-ray-launcher 1.2.2: its local mode runs with Ray 2.60
(checked with the package on the path, nothing installed), but
- it cannot keep Ray on loopback: its `ray.init` with
  `_node_ip_address` set to the loopback address still left the GCS listening on `*:PORT`
  (`ss -ltnp` during a sweep), and it has no hook to start the cluster
  anywhere else;
- installing it would change the environment: it requires `cloudpickle<3`
  (a downgrade from 3.1), `ray[default]`, boto3 and aiohttp, 34 packages in
  all, for the AWS mode this project does not use.
This launcher does what its local mode does (one task per point, Hydra's
`run_job` inside) in a page, with the cluster placed where testbed wants it."""
# no `from __future__ import annotations`: Hydra's plugin scan runs this module before it is in
# sys.modules, where dataclasses looks string annotations up
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

log = logging.getLogger(__name__)


@dataclass
class RaySweepLauncherConf:
    _target_: str = "hydra_plugins.testbed_ray_launcher.ray_launcher.RaySweepLauncher"
    # null: a local cluster for the sweep, shut down after it; "auto" or "HOST:PORT": join that cluster
    address: Optional[str] = None
    # address null: the sweep (driver, cluster, points) in a private loopback-only network namespace (needs root);
    # false: Ray listens on every interface
    private_netns: bool = True
    host: str = "127.0.0.1"             # the local cluster's node address
    num_cpus: Optional[int] = None      # the local cluster's CPUs; null: this machine's
    cpus_per_point: float = 1.0         # each point's Ray task asks for this: num_cpus / cpus_per_point run at once
    gpus_per_point: float = 0.0


ConfigStore.instance().store(group="hydra/launcher", name="ray", node=RaySweepLauncherConf,
                             provider="testbed_ray_launcher")


def run_point(idx: int, overrides: Sequence[str], cwd: str, hydra_context: HydraContext, config: DictConfig,
              task_function: TaskFunction, singleton_state: Dict[Any, Any]) -> JobReturn:
    """One point, in a Ray worker: Hydra's run_job, from the driver's working
    directory (relative run directories resolve as on the command line)."""
    os.chdir(cwd)
    setup_globals()
    Singleton.set_state(singleton_state)
    sweep_config = hydra_context.config_loader.load_sweep_config(config, list(overrides))
    with open_dict(sweep_config):
        sweep_config.hydra.job.id = f"{sweep_config.hydra.job.name}_{idx}"
        sweep_config.hydra.job.num = idx
    return run_job(hydra_context=hydra_context, task_function=task_function, config=sweep_config,
                   job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")


class RaySweepLauncher(Launcher):
    def __init__(self, address: Optional[str] = None, private_netns: bool = True, host: str = "127.0.0.1",
                 num_cpus: Optional[int] = None, cpus_per_point: float = 1.0, gpus_per_point: float = 0.0) -> None:
        if num_cpus is not None and num_cpus < 1:
            raise ValueError(f"hydra.launcher.num_cpus: must be >= 1 or null, got {num_cpus}")
        if not cpus_per_point > 0:
            raise ValueError(f"hydra.launcher.cpus_per_point: must be > 0, got {cpus_per_point}")
        self.address, self.private_netns, self.host = address, private_netns, host
        self.num_cpus, self.cpus_per_point, self.gpus_per_point = num_cpus, cpus_per_point, gpus_per_point
        self.config: Optional[DictConfig] = None
        self.hydra_context: Optional[HydraContext] = None
        self.task_function: Optional[TaskFunction] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def _connect(self) -> bool:
        """ray.init as configured; True when this launcher did it (and shuts it down)."""
        from testbed.launchers.ray import connect
        return connect(self.address, self.host, self.num_cpus or os.cpu_count(), self.private_netns, timeout_s=120.0)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import ray
        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        started = self._connect()
        try:
            task = ray.remote(num_cpus=self.cpus_per_point, num_gpus=self.gpus_per_point, max_retries=0)(run_point)
            log.info(f"Ray ({ray.cluster_resources().get('CPU', 0):g} CPUs, {self.cpus_per_point:g} per point) "
                     f"is launching {len(job_overrides)} jobs, sweep output dir: {sweep_dir}")
            state, refs = Singleton.get_state(), []
            for i, overrides in enumerate(job_overrides):
                log.info(f"\t#{initial_job_idx + i} : {' '.join(filter_overrides(overrides))}")
                refs.append(task.remote(initial_job_idx + i, list(overrides), os.getcwd(), self.hydra_context,
                                        self.config, self.task_function, state))
            return ray.get(refs)
        finally:
            if started:
                ray.shutdown()         # a local cluster stops with it; a joined one only loses this driver
