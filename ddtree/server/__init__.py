"""`ddtree serve`: an OpenAI-compatible HTTP server on the decode session.

- `app`: the FastAPI app and its routes; `create_app(settings)` builds one (tests pass small settings).
- `worker`: the decode thread, the one owner of the `DecodeSession`; handlers reach it through a bounded
  queue and get tokens back through an asyncio queue of their own.
- `generation`: one request on the handler's side; `text`: incremental detokenization and stop strings;
  `prompts`, `schemas`, `responses`, `errors`: OpenAI's formats; `metrics`: Prometheus; `model`: the
  settings and the loaded pair.
- Hostile clients: `connections` (uvicorn's h11 protocol with a header timeout and a connection cap),
  `gate` (body size and body timeout), `faults` (no exception or traceback reaches a client), `logs`
  (a repeated log line once a minute); `schemas` and `prompts` refuse what the tokenizer cannot take.

Telemetry: in this increment the session's step observer is the no-op one; `DDTREE_DEBUG_METRICS` step
telemetry (spans, step logs, step metrics) in the server comes later. The server's own HTTP metrics are on
its `/metrics`. Nothing here logs prompt or completion text, or token ids.
"""
