"""`triton.jit` for the kernel modules, typed for mypy (triton has no stubs). Imports triton: only the kernel
modules import it, lazily."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import triton

F = TypeVar("F", bound=Callable[..., Any])


def jit(fn: F) -> F:
    """`triton.jit(fn)`; the result is a Triton JITFunction (an InterpretedFunction under TRITON_INTERPRET=1)."""
    return cast(F, triton.jit(fn))
