"""pd-testbed."""
