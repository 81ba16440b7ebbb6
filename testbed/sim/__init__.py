"""The simulator's physics: cost model, GPU operator tables, link model, jitter."""
