"""`specport serve`: an OpenAI-compatible ASGI server (FastAPI + uvicorn) over one engine.

- `app.py`: `make_app(model, engine, settings)`, the FastAPI app (routes, errors);
  `generate.py`: one request through the engine (whole answer or SSE stream); `state.py`: the
  settings, the shared state and the access log;
- `protocol.py` / `fields.py` / `schemas.py` / `responses.py` / `api_error.py`: the OpenAI wire
  format, in and out;
- `bridge.py`: engine thread -> event loop; `guard.py`: limits and client timeouts;
- `metrics.py`: Prometheus `/metrics` under vLLM's names; `server.py`: uvicorn;
- `ray.py`: the same app as a Ray Serve deployment (`specport serve --replicas N`).
The load test (`specport loadtest`) lives in `specport.bench.loadtest`.
"""
