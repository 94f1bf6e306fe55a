"""A zero-sync check that does not care who calls: every host read of device data made while a telemetry hook
runs is recorded, whatever the calling frame, module or stdlib function in between.

Three layers, all active only for the duration of one hook call:

- a `TorchDispatchMode` that flags `aten::_local_scalar_dense` and `aten::item` (`.item()`, `int(t)`,
  `float(t)`, `bool(t)`, `torch.equal`, indexing a list with a tensor, `statistics.fmean(t)` and anything else
  that turns a tensor element into a Python number), every device-to-host copy that is not `non_blocking`
  (`.cpu()`, `.to("cpu")`, `host.copy_(t)`, `.tolist()` of a CUDA tensor), and ops whose output shape
  depends on device data (`nonzero`, boolean-mask indexing, `unique`), which wait for the device on CUDA;
- `torch.cuda.synchronize`, `torch.cuda.Event.synchronize`, `torch.cuda.Stream.synchronize` and
  `torch.accelerator.synchronize` replaced by recorders (and `torch.cuda.is_available` answering True on a
  machine without CUDA, so that a sync hidden behind that test runs and is seen);
- the CPU proxy for "device data": on a GPU the engine hands hooks CUDA tensors, and a host read of them is a
  copy the dispatch mode sees. On CPU they are host tensors already, and `.numpy()`, `.tolist()` or `.cpu()`
  of them dispatch nothing. So on CPU every tensor passed to a hook is tagged (`DeviceTensor`, a subclass
  that carries over to every tensor computed from it, and stays with a tensor kept for a later hook), and any
  read of a tagged tensor's data on the host is flagged: the reads above, `.numpy()`, `np.asarray(t)`,
  `.tolist()`, `repr`. Copying one into a host buffer with `non_blocking=True`, the collector's way, passes.
"""

from __future__ import annotations

import contextlib
import sysconfig
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ddtree.methods import TreeShape
from ddtree.observer import GenerateInfo, RequestResult, StepObserver, StepProbe

# Tensor methods that read a tagged tensor's data into host memory without any dispatch on CPU.
HOST_READS = frozenset({"numpy", "tolist", "cpu", "item", "__array__", "__dlpack__", "__repr__", "__format__"})
SCALARS = ("_local_scalar_dense", "item", "is_nonzero", "equal")  # `item` stays whole under inference mode
SCALAR_READ = "scalar read"
# Ops whose output shape depends on the data: on CUDA they wait for the device to learn it.
DATA_SHAPED = ("nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive", "repeat_interleave")
COPIES = ("to", "_to_copy", "copy_", "_copy_from", "_copy_from_and_resize")
SYNCS: list[tuple[Any, str]] = [
    (torch.cuda, "synchronize"),
    (torch.cuda.Event, "synchronize"),
    (torch.cuda.Stream, "synchronize"),
    (torch.accelerator, "synchronize"),
]
_HERE = str(Path(__file__).resolve())
_TORCH = str(Path(torch.__file__).resolve().parent)
_STDLIB = str(Path(sysconfig.get_paths()["stdlib"]).resolve())


class DeviceTensor(torch.Tensor):
    """A CPU tensor that stands for one on the device (see the module docstring)."""

    guard: ClassVar[SyncGuard | None] = None  # the guard watching now, if any

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        name = getattr(func, "__name__", "")
        if cls.guard is not None and name in HOST_READS:
            cls.guard.flag(SCALAR_READ + " (Tensor.item)" if name == "item" else f"Tensor.{name} of device data")
        return super().__torch_function__(func, types, args, kwargs or {})  # type: ignore[no-untyped-call]


def on_device(t: torch.Tensor) -> bool:
    return t.device.type != "cpu" or isinstance(t, DeviceTensor)


def _device_data(args: tuple[Any, ...], bool_only: bool) -> bool:
    """True when a tensor argument (or one in a list: `index`'s indices) is device data (a bool mask, if
    `bool_only`)."""
    flat = [a for arg in args for a in (arg if isinstance(arg, (list, tuple)) else [arg])]
    tensors = [t for t in flat if isinstance(t, torch.Tensor) and on_device(t)]
    return any(t.dtype == torch.bool for t in tensors) if bool_only else bool(tensors)


def _bound(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    names = [a.name for a in func._schema.arguments]
    return {**dict(zip(names, args, strict=False)), **kwargs}


def blocking_device_to_host(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """True for a copy from device data into host memory that is not `non_blocking`."""
    bound = _bound(func, args, kwargs)
    if bound.get("non_blocking"):
        return False
    if "src" in bound:  # copy_(self, src): into self
        dst, src = bound["self"], bound["src"]
        return on_device(src) and not on_device(dst)
    src = bound.get("self")
    if not isinstance(src, torch.Tensor) or not on_device(src):
        return False
    other = bound.get("other")
    if isinstance(other, torch.Tensor):
        return not on_device(other)
    device = bound.get("device")
    return device is not None and torch.device(device).type == "cpu"


class _HostReads(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, guard: SyncGuard) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.guard = guard

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket.__name__
        if packet in SCALARS:
            self.guard.flag(f"{SCALAR_READ} (aten::{packet})")
        elif packet in COPIES and blocking_device_to_host(func, args, kwargs):
            self.guard.flag(f"blocking device-to-host aten::{packet}")
        elif (packet in DATA_SHAPED or packet == "index") and _device_data(args, bool_only=packet == "index"):
            self.guard.flag(f"data-dependent shape aten::{packet}")
        return func(*args, **kwargs)


class SyncGuard:
    """Collects violations; `watch(hook)` is the window in which anything is a violation."""

    def __init__(self) -> None:
        self.violations: list[str] = []
        self.calls: Counter[str] = Counter()
        self.hook = ""
        self.cuda = torch.cuda.is_available()

    def flag(self, what: str) -> None:
        self.violations.append(f"{what} in {self.hook} at {_caller()}")

    @contextlib.contextmanager
    def watch(self, hook: str) -> Iterator[None]:
        self.hook = hook
        self.calls[hook] += 1
        with contextlib.ExitStack() as stack:
            for owner, name in SYNCS:
                stack.enter_context(_patched(owner, name, self._recorder(owner, name)))
            if not self.cuda:
                stack.enter_context(_patched(torch.cuda, "is_available", lambda: True))
            else:  # printing a tensor copies it to the host with dispatch modes off: watch the printer itself
                stack.enter_context(_patched(torch._tensor_str, "_str", self._printer(torch._tensor_str._str)))
            stack.enter_context(_HostReads(self))
            DeviceTensor.guard = self
            try:
                yield
            finally:
                DeviceTensor.guard = None

    def _recorder(self, owner: Any, name: str) -> Callable[..., None]:
        original = getattr(owner, name)
        label = f"{getattr(owner, '__name__', owner)}.{name}"

        def record(*args: Any, **kwargs: Any) -> None:
            self.flag(label)
            if self.cuda:
                original(*args, **kwargs)

        return record

    def _printer(self, original: Callable[..., str]) -> Callable[..., str]:
        def record(t: torch.Tensor, *args: Any, **kwargs: Any) -> str:
            if on_device(t):
                self.flag("Tensor.__format__ or __repr__ of device data")
            return original(t, *args, **kwargs)

        return record

    def tag(self, value: Any) -> Any:
        """On CPU, `value` with every tensor field tagged as device data (the engine's tensors are device
        tensors on a GPU, where no tag is needed)."""
        if self.cuda:
            return value
        if isinstance(value, torch.Tensor):
            return value.as_subclass(DeviceTensor)
        if is_dataclass(value) and not isinstance(value, type):
            return replace(value, **{f.name: self.tag(getattr(value, f.name)) for f in fields(value)})
        return value


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _caller() -> str:
    """The innermost frame outside torch, the standard library and this module: where the read was written."""
    for frame in reversed(traceback.extract_stack()):
        path = str(Path(frame.filename).resolve())
        if path != _HERE and not path.startswith((_TORCH, _STDLIB)):
            return f"{Path(frame.filename).name}:{frame.lineno} ({frame.name})"
    return "?"


class GuardedObserver:
    """A `StepObserver` that runs `inner`'s every hook under `guard`, with device tensors tagged."""

    def __init__(self, inner: StepObserver, guard: SyncGuard) -> None:
        self.inner = inner
        self.guard = guard

    def on_session(self, stamped: bool) -> None:
        with self.guard.watch("on_session"):
            self.inner.on_session(stamped)

    def on_generate_start(self, info: GenerateInfo) -> None:
        with self.guard.watch("on_generate_start"):
            self.inner.on_generate_start(info)

    def on_step_start(self, step: int, batch_size: int, warmup: bool = False, shape: TreeShape | None = None) -> None:
        with self.guard.watch("on_step_start"):
            self.inner.on_step_start(step, batch_size, warmup, shape)

    def on_stage_start(self, stage: str) -> None:
        with self.guard.watch("on_stage_start"):
            self.inner.on_stage_start(stage)

    def on_stage_end(self, stage: str) -> None:
        with self.guard.watch("on_stage_end"):
            self.inner.on_stage_end(stage)

    def on_tree(self, tree: Any) -> None:
        with self.guard.watch("on_tree"):
            self.inner.on_tree(self.guard.tag(tree))

    def on_probe(self, step: int, probe: StepProbe) -> None:
        with self.guard.watch("on_probe"):  # host arrays the loop read back: nothing to tag
            self.inner.on_probe(step, probe)

    def on_accept(self, step: int, result: Any, accepted: list[int]) -> None:
        with self.guard.watch("on_accept"):
            self.inner.on_accept(step, self.guard.tag(result), accepted)

    def on_step_end(self, step: int, emitted: list[int]) -> None:
        with self.guard.watch("on_step_end"):
            self.inner.on_step_end(step, emitted)

    def on_generate_end(self, results: list[RequestResult]) -> None:
        with self.guard.watch("on_generate_end"):
            self.inner.on_generate_end(results)
