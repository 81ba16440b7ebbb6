"""Tools that read a finished study's or run's files back (python -m
testbed.analysis.NAME): the decision grid's L* table, re-run cells against
the grid, steadiness restated from a study's probes, late TBT gaps by cause,
and the condensed Vidur operator tables the GPU presets read."""
