"""DDTree inside SGLang 0.5.23: `--speculative-algorithm DDTREE` through SGLang's plugin entry point.

- `plugin`: the entry point (`sglang.srt.plugins`), run by SGLang in each of its processes.
- `spec`: the algorithm's registry entry; `worker`: the decode step; `tree_step`: its tensor work (pure torch).
- `config`: settings from the environment and the start-up checks.
- `observe`: our telemetry in SGLang's scheduler process (DDTREE_DEBUG_METRICS=1).
- `cpu`: opt-in patches (DDTREE_SGLANG_CPU=1) that let SGLang run DFlash and DDTREE on a CPU.

Importing this package imports nothing from SGLang.
"""
