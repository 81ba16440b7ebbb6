"""`testbed`: the command line.

  testbed run [hydra overrides]      one run (or a sweep with -m)
  testbed report RUN_DIR...          tables and plots from run directories
  testbed profile [--quick] [--out]  measure this machine for runtime=sim
  testbed capacity [hydra overrides] highest workload.rate meeting slo.* (binary search)
  testbed data list|fetch|import     public datasets by name (testbed data -h)
"""
from __future__ import annotations

import sys

USAGE = __doc__
MULTIRUN_FLAGS = ("-m", "--multirun")


def _hydra_run(argv: list[str]) -> int:
    from testbed.cli_errors import hydra_raises, override_error, refused_override
    from testbed.output_faults import output_fault
    # Hydra's parser takes -m only before the overrides ("unrecognized arguments" after them)
    argv = [a for a in argv if a in MULTIRUN_FLAGS] + [a for a in argv if a not in MULTIRUN_FLAGS]
    refused = refused_override(argv)
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        return 2
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig, OmegaConf

    from testbed.config import RunConfig, register_configs
    from testbed.data.config import use_data_dir
    from testbed.interrupts import Interrupts
    from testbed.model.config import CONF_DIR
    from testbed.run import execute

    register_configs()
    _register_sweep_launchers()

    started = []

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
    def task(dcfg: DictConfig):
        started.append(True)
        hc = HydraConfig.get()
        multirun = hc.mode.name == "MULTIRUN"
        out_dir = hc.runtime.output_dir
        try:
            use_data_dir(dcfg.data.dir)
            cfg: RunConfig = OmegaConf.to_object(dcfg)
            if multirun:
                _name_sweep_point(cfg, hc, argv)
                _stdlib_start_method()
            signals = Interrupts()
            try:
                with signals.terminate_as_interrupt():      # SIGTERM stops a run as Ctrl-C does
                    summary = execute(cfg, out_dir)
            except KeyboardInterrupt:
                print(f"interrupted: whatever was written is in {out_dir}", file=sys.stderr)
                raise SystemExit(signals.exit_code) from None
            if summary.get("interrupted"):
                # what was measured is written; a sweep stops here too, as Ctrl-C means
                print(f"interrupted: partial results in {out_dir}", file=sys.stderr)
                raise SystemExit(signals.exit_code)
            return summary
        except (ValueError, TimeoutError, RuntimeError, OSError) as e:
            message = str(e) if isinstance(e, (ValueError, TimeoutError, RuntimeError)) else output_fault(e, out_dir)
            if message is None:
                raise
            print(f"error: {message}", file=sys.stderr)
            if not multirun:
                raise SystemExit(2)
            # a failed sweep point is recorded and the sweep goes on
            import json
            from pathlib import Path
            Path(out_dir, "failed.json").write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
            return None

    sys.argv = [sys.argv[0]] + argv
    with hydra_raises():
        try:
            task()
        except Exception as e:       # a bad override, in one line; anything else keeps its traceback
            message = override_error(e, task_started=bool(started), argv=argv)
            if message is None:
                raise
            print(f"error: {message}", file=sys.stderr)
            return 2
    return 0


def _register_sweep_launchers() -> None:
    """hydra/launcher=ray (testbed/launchers/hydra_ray, installed as
    hydra_plugins.testbed_ray_launcher, the only namespace Hydra takes plugins from). Hydra finds
    plugins by listing the hydra_plugins namespace, which an editable install's
    import hook does not list: register it by name as well (a no-op when found)."""
    from hydra.core.plugins import Plugins
    try:
        from hydra_plugins.testbed_ray_launcher.ray_launcher import RaySweepLauncher
    except ImportError:         # an install older than the plugin: hydra/launcher=ray is then unknown, nothing else
        return
    Plugins.instance().register(RaySweepLauncher)


def _stdlib_start_method() -> None:
    """hydra/launcher=joblib runs a point in a loky worker, whose default
    multiprocessing start method is 'loky'; a child spawned from there
    (launcher=local's workers) is told to use it and cannot find it. Put this
    process's default back to a start method every child knows."""
    import multiprocessing as mp
    if mp.get_start_method(allow_none=True) not in (None, *mp.get_all_start_methods()):
        mp.set_start_method("spawn", force=True)


def _name_sweep_point(cfg, hc, argv: list[str]) -> None:
    """W&B: the sweep is the group (unless wandb.group is set), the point is
    named by what its overrides change (unless wandb.name is set)."""
    from testbed.sweep_names import point_name, sweep_group, swept_keys
    cfg.wandb.group = cfg.wandb.group or sweep_group(hc.sweep.dir)
    cfg.wandb.name = cfg.wandb.name or point_name(list(hc.overrides.task), swept_keys(argv))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "run":
        return _hydra_run(rest)
    if cmd == "report":
        from testbed.report import report_main
        return report_main(rest)
    if cmd == "profile":
        from testbed.profiling.profile import profile_main
        return profile_main(rest)
    if cmd == "capacity":
        from testbed.capacity import capacity_main
        return capacity_main(rest)
    if cmd == "data":
        from testbed.data.cli import data_main
        return data_main(rest)
    print(f"testbed: unknown command '{cmd}'\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
