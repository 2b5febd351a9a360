"""The gateway: OpenAI- and Anthropic-compatible HTTP front door of deepserve.

Module map (a request's path, top to bottom):
- ``cli.py``: ``deepserve gateway`` (in front of a worker or router service) and ``deepserve up``.
- ``up.py``: the embedded stack: tiny checkpoint, engine worker processes, in-process router.
- ``app.py``: ``create_app(config, engine_client)``: routes, error handlers, metrics middleware.
- ``routes/``: one module per route group (chat, completions, responses, messages, models,
  health, metrics).
- ``handler.py``: the shared path of the three deepseek-recipe protocols (auth, body, convert,
  encode, admit, stream or accumulate).
- ``generation.py``: ``Run``: engine token events through a recipe ``StreamProcessor`` into
  protocol chunks; abort on stop sequence, error or disconnect.
- ``convert.py``: converted request -> ``deepserve.protocol.GenerateRequest``.
- ``limits.py``: API keys, token-bucket rate limits, admission queue, body-size limit.
- ``errors.py``: the error hierarchy and its OpenAI / Anthropic JSON.
- ``model.py``: served names, tokenizer, V4 / V4.1 encodings, special token ids.
- ``metrics.py``: ``deepserve_http_*`` metrics and the merge of the workers' metrics.
- ``engine_client.py``: the ``EngineClient`` protocol the gateway programs against.
- ``config.py``: ``GatewayConfig`` (CLI flags and ``DEEPSERVE_*`` variables), ``state.py``: the
  per-app ``Gateway`` state on ``app.state.gateway``; ``sse.py``, ``schemas.py``: framing, OpenAPI.
"""
