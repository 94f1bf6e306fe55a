"""The GPU's own clock, read in stream order: the stage times of a step captured whole in one CUDA graph.

Host-side marks (CUDA events recorded between stages) need the host to run between the stages, so a graphed
step would have to be one graph per stage. `stamp(buffer, i)` is a one-program kernel that writes the GPU's
`%globaltimer` (nanoseconds) into `buffer[i]` when the work queued before it on the stream has finished: a
plain kernel launch, so a graph can capture it between the stages and replay it with them. The stamps are in
the GPU's clock, not the host's: only their differences mean something.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import torch


def stamps_available(device: torch.device) -> bool:
    """Whether `stamp` can run for tensors on `device`: an NVIDIA CUDA device, triton importable, and the kernel not
    built for Triton's interpreter (TRITON_INTERPRET=1), which cannot run inline PTX."""
    if device.type != "cuda" or torch.version.hip:  # the kernel is NVIDIA PTX; ROCm's devices are "cuda" too
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return not _interpreting()


def _interpreting() -> bool:
    """Whether the kernel is built for the interpreter: triton decides when the module is first imported, so
    once it is, its kernel tells; before, TRITON_INTERPRET does."""
    module = sys.modules.get("ddtree.kernels._clock_triton")
    if module is None:
        return os.environ.get("TRITON_INTERPRET", "") == "1"
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(module.stamp_kernel, InterpretedFunction)


def _kernels() -> ModuleType:
    return importlib.import_module("ddtree.kernels._clock_triton")


def stamp(buffer: torch.Tensor, index: int) -> None:
    """Write the GPU clock (ns) into `buffer[index]` (`buffer`: int64 on a CUDA device) once the work queued
    before this call on the current stream has finished. Capturable in a CUDA graph, but a first call may compile
    (triton specializes on `index`): call it with each index once before a capture (`ddtree.engine.graphs`)."""
    if not 0 <= index < buffer.numel():
        raise IndexError(f"stamp {index} is outside a buffer of {buffer.numel()}")
    _kernels().stamp_kernel[(1,)](buffer, index, num_warps=1)
