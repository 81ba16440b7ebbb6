"""`hydra/launcher=ray`: sweep points as Ray tasks (ray_launcher.py). Installed as the package
`hydra_plugins.testbed_ray_launcher` (pyproject.toml's package-dir): Hydra instantiates plugins only from
the hydra_plugins namespace. Import it by that name, never as testbed.launchers.hydra_ray."""
