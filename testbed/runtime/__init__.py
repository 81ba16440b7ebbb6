"""The two runtimes (real processes, discrete-event simulation) and what they share above the worker."""
