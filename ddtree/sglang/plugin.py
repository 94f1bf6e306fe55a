"""The `sglang.srt.plugins` entry point: SGLang calls `register` once in every process it starts."""

from __future__ import annotations

import os
from typing import Any

CPU_ENV = "DDTREE_SGLANG_CPU"


def register() -> None:
    """Register `--speculative-algorithm DDTREE` (and, with DDTREE_SGLANG_CPU=1, apply the CPU patches; with
    DDTREE_DEBUG_METRICS=1, hook SGLang's result processing for our telemetry)."""
    if os.environ.get(CPU_ENV) == "1":
        from ddtree.sglang import cpu

        cpu.apply()
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    from ddtree.sglang import hybrid, observe
    from ddtree.sglang.spec import NAME, DDTreeSpecAlgo

    if get_spec(NAME) is not None:
        return  # already registered in this process
    hybrid.patch_pool_layout(NAME)  # a GDN target's verify scratch: one convolution window per tree node
    if observe.enabled():
        observe.register_hooks()  # telemetry in the scheduler: the decode step's counts as SGLang reads them
    SpeculativeAlgorithm.register(NAME, supports_overlap=True, spec_class=DDTreeSpecAlgo)(_worker_class)


def _worker_class(server_args: Any) -> type:
    from ddtree.sglang.worker import DDTreeWorker

    return DDTreeWorker
