"""Attention backends (torch reference, Triton, flash-attn) and KV gather/scatter kernels."""
