"""DDTree inside SGLang 0.5.23: `--speculative-algorithm DDTREE` through SGLang's plugin entry point.

- `plugin`: the entry point (`sglang.srt.plugins`), run by SGLang in each of its processes.
- `spec`: the algorithm's registry entry; `worker`: the decode step; `tree_step`: its tensor work (pure torch).
- `hybrid`: gated-delta-net hybrid targets (Qwen3-Next, Qwen3.5): SGLang's linear-attention backend in tree
  mode for each verify, and the commit of its recurrent states along the accepted path.
- `config`: settings from the environment and the start-up checks.
- `observe`: our telemetry in SGLang's scheduler process (DDTREE_DEBUG_METRICS=1).
- `cpu`: opt-in patches (DDTREE_SGLANG_CPU=1) that let SGLang run DFlash and DDTREE on a CPU (`cpu_attention`,
  and `cpu_gdn`'s torch stand-ins for the Triton kernels of gated-delta-net targets).

Importing this package imports nothing from SGLang.
"""
