"""The embedded decode loop (`ddtree.engine.decode`) and its KV cache (`ddtree.engine.kv_cache`)."""
