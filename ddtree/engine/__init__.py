"""The embedded decode loop (`ddtree.engine.decode`) and its KV cache (`ddtree.kv_cache`)."""
