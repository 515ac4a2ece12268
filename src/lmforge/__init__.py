"""lmforge: from an empty directory to a trained, evaluated, served and monitored language model.

Each stage is a package (model, tokenizer, data, train, eval, engine, serve, perf, track) and a
verb of the `lmforge` command. See docs/architecture.md.
"""

__version__ = "0.1.0"
