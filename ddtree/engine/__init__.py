"""The embedded decode loop (`ddtree.engine.engine`) and its KV cache (`ddtree.kv_cache`)."""
