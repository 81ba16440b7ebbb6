"""Where there is no GPU, Triton kernels can only run through Triton's
interpreter, and Triton decides that once, when a kernel (or triton.language
itself) is decorated at import time. The Triton kernel modules call
`interpret_without_gpu()` before importing triton, so the CPU engine and the
CPU tests run the same kernel source as the GPU does."""
from __future__ import annotations

import os
import sys

import torch


def interpret_without_gpu() -> None:
    """Turn on TRITON_INTERPRET unless a GPU is present, someone chose
    explicitly, or triton is already imported (too late to change)."""
    if "triton" not in sys.modules and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def check_runnable(kernel, device: torch.device) -> None:
    """A clear error instead of Triton's 'no GPU driver' when CPU tensors meet
    a compiled kernel."""
    from triton.runtime.interpreter import InterpretedFunction
    if device.type != "cuda" and not isinstance(kernel, InterpretedFunction):
        raise RuntimeError(f"Triton kernels run on {device} tensors only through Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before triton is first imported, or use CUDA tensors")
