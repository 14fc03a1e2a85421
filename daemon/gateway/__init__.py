"""The OpenAI-compatible HTTP gateway: an HTTP server (Starlette on uvicorn)
that is one more ZeroMQ client of the daemon (docs/architecture.md, ## The
gateway). It never imports the engine or torch (tests/test_layers.py).

- settings.py: its options, and who may reach it;
- openai_api.py: OpenAI request bodies -> `generate` messages, and errors;
- responses.py: `delta`/`final` frames -> OpenAI responses and SSE chunks;
- link.py: the connection to the daemon;
- metrics.py: `GET /metrics` from the daemon's stats;
- app.py: the routes;
- run.py: uvicorn, in the foreground (`ridge gateway`) or on a thread of the
  daemon (`ridge serve --http`)."""
