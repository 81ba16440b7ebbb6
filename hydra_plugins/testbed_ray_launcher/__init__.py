"""`hydra/launcher=ray`: sweep points as Ray tasks (ray_launcher.py)."""
