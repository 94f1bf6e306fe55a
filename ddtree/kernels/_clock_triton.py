"""The Triton kernel of `ddtree.kernels.clock`, which explains it and launches it.

Imported lazily, on the first call (the core install may lack triton). The inline PTX runs on NVIDIA GPUs only,
so this kernel has no interpreter path (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import triton.language as tl

from ddtree.kernels._jit import jit as _jit


@_jit
def stamp_kernel(
    out_ptr: tl.tensor,  # [stamps] int64: the buffer a step's stamps go to
    index: tl.tensor,  # the entry this launch writes
) -> None:
    """One program: read the GPU's global timer (nanoseconds) and store it at `out_ptr[index]`. Not pure: the
    compiler must neither merge nor move the read."""
    now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(out_ptr + index, now)
