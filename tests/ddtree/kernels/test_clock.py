"""The GPU clock stamp (`ddtree.kernels.clock`): inline PTX, so it runs on a CUDA GPU only (not in Triton's
interpreter). On CPU the kernel is still compiled to PTX for an H200 (sm_90), which needs no GPU."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddtree.kernels.clock import stamp, stamps_available

ROOT = Path(__file__).resolve().parents[3]
DEVICE = torch.device(os.environ.get("DDTREE_TEST_DEVICE", "cpu"))
if DEVICE.type == "cuda" and importlib.util.find_spec("triton") is not None:
    # Built now, at collection: test_tree_build.py sets TRITON_INTERPRET=1 for the whole run when collected.
    importlib.import_module("ddtree.kernels._clock_triton")
needs_cuda = pytest.mark.skipif(
    not (DEVICE.type == "cuda" and stamps_available(DEVICE)),
    reason="the stamp kernel is inline PTX: it needs a CUDA device and triton (DDTREE_TEST_DEVICE=cuda)",
)


def test_no_stamps_off_a_cuda_device() -> None:
    assert not stamps_available(torch.device("cpu"))


def test_no_stamps_on_rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    """ROCm's devices are "cuda" to torch, but the kernel is NVIDIA PTX."""
    pytest.importorskip("triton", reason="triton is not installed (it is in the dev extra)")
    from ddtree.kernels import clock

    monkeypatch.setattr(clock, "_interpreting", lambda: False)  # as a compiled kernel on a GPU machine
    monkeypatch.setattr(torch.version, "hip", None)
    assert stamps_available(torch.device("cuda"))
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert not stamps_available(torch.device("cuda"))


def test_no_stamps_from_a_kernel_built_for_the_interpreter() -> None:
    """On CPU the tests run Triton's interpreter (TRITON_INTERPRET=1), which cannot run inline PTX."""
    pytest.importorskip("triton", reason="triton is not installed (it is in the dev extra)")
    from triton.runtime.interpreter import InterpretedFunction

    from ddtree.kernels._clock_triton import stamp_kernel

    assert stamps_available(torch.device("cuda")) is not isinstance(stamp_kernel, InterpretedFunction)
    assert DEVICE.type == "cuda" or isinstance(stamp_kernel, InterpretedFunction)


# Compiles the kernel in a fresh interpreter without TRITON_INTERPRET: Triton's interpreter leaves triton.language.core
# patched for good once a kernel calls a jitted library function (tl.sum, tl.max, ...), so that, in this process, a
# compile of `out_ptr + index` reaches the interpreter's builder. A cache of its own, so the PTX is compiled here.
_COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ddtree.kernels._clock_triton import stamp_kernel

source = ASTSource(fn=stamp_kernel, signature={"out_ptr": "*i64", "index": "i32"}, constexprs={})
print(triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"])
"""


def test_the_kernel_reads_the_global_timer_into_its_entry(tmp_path: Path) -> None:
    """Compiled for sm_90 without a GPU: one 64-bit read of %globaltimer and one store."""
    pytest.importorskip("triton", reason="triton is not installed (it is in the dev extra)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_SM90], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    ptx = done.stdout
    assert ptx.count("%globaltimer") == 1
    assert ptx.count("st.global.b64") == 1


@needs_cuda
def test_stamps_increase_in_stream_order() -> None:
    """Each stamp is written after the work queued before it: a matmul between two stamps takes time."""
    stamps = torch.zeros(3, dtype=torch.int64, device=DEVICE)  # [3]
    a = torch.randn((2048, 2048), device=DEVICE)
    stamp(stamps, 0)
    for _ in range(8):
        a = a @ a / 2048
    stamp(stamps, 1)
    stamp(stamps, 2)
    values = stamps.tolist()
    assert 0 < values[0] < values[1] <= values[2]
    assert values[1] - values[0] > 1000, "eight 2048^3 matmuls take more than a microsecond"


@needs_cuda
def test_a_captured_graph_stamps_on_every_replay() -> None:
    stamps = torch.zeros(2, dtype=torch.int64, device=DEVICE)  # [2]
    for i in range(2):
        stamp(stamps, i)  # compiled before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stamp(stamps, 0)
        stamp(stamps, 1)
    graph.replay()
    first = stamps.tolist()
    graph.replay()
    second = stamps.tolist()
    assert first[0] <= first[1] < second[0] <= second[1]


def test_an_index_outside_the_buffer_is_refused() -> None:
    with pytest.raises(IndexError, match="outside a buffer of 2"):
        stamp(torch.zeros(2, dtype=torch.int64), 2)
