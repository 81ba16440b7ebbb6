"""pd-testbed: chunked-prefill colocation and prefill/decode disaggregation on one engine, real or simulated."""
