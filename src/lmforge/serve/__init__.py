"""lmforge.serve: the OpenAI-compatible HTTP server over the engine.

`config.py` holds the typed settings (`ServerConfig`), `app.py` assembles routes over one serving
class per endpoint and the `EngineClient`, `commands.py` is the `lmforge serve` verb. It knows
nothing about scheduling, sampling or KV paging (the engine's), nor about training.
"""
