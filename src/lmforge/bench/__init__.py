"""Benchmarks: every `lmforge bench ...` runner and the measured-vs-estimate checks.

Measurement code only: each module times or measures something the library does and writes JSON +
Markdown. Nothing in the library imports this package (only `cli.py` and `quickstart.py` do), so
the code being measured never depends on the code that measures it.
"""
