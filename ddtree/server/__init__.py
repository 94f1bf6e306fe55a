"""`ddtree serve`: an OpenAI-compatible HTTP server on the decode session, in processes.

```
              +-- API process 0: uvicorn, FastAPI, tokenize, detokenize, SSE --+
 clients ---> |   ...                (one listening socket, shared)           | <--ZMQ, msgspec--> engine process:
              +-- API process N-1 -------------------------------------------+                   decode session,
                                                                                                warm-up, telemetry
```

- `launch`: the launcher (`serve`): binds the port, starts the engine process and the API processes, and
  supervises them (signals, a dead engine, a dead API process).
- `core`: the engine core process: `worker`'s decode thread (the one owner of the `DecodeSession`) and the
  inbox; `transport`: the typed messages between the processes; `client`: the API process's side of them.
- `app`: the FastAPI app and its routes over an `EngineLink` (`link`): `api_app` in an API process,
  `create_app(settings)` over a decode thread in this process (tests pass small settings).
- `generation`: one request on the handler's side; `text`: incremental detokenization and stop strings;
  `prompts`, `schemas`, `responses`, `errors`: OpenAI's formats; `metrics`: Prometheus; `model`: the
  settings and the loaded pair; `card`: what an API process knows of it.
- Hostile clients: `connections` (uvicorn's h11 protocol with a header timeout and a connection cap),
  `gate` (body size and body timeout), `faults` (no exception or traceback reaches a client), `logs`
  (a repeated log line once a minute); `schemas` and `prompts` refuse what the tokenizer cannot take.

Telemetry runs in the engine process (spans, step logs, step metrics with `DDTREE_DEBUG_METRICS=1`); the
server's own HTTP and request metrics are on `/metrics`, summed over the API processes. Nothing here logs
prompt or completion text, or token ids.
"""
