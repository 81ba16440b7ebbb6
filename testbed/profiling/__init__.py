"""Measuring this machine for runtime=sim (`testbed profile`): engine-step GEMM
tables, attention rows, a calibrated overhead fit and step jitter, written as a
hardware config that the torch-free physics in testbed/sim/ reads."""
