"""lmforge.eval: frozen suites, perplexity / bits-per-byte, exact match, log-likelihood choice,
stability, and comparisons between runs. See docs/eval.md.

    from lmforge.eval import TransformerBackend, evaluate, load_suite
    evaluate(TransformerBackend("runs/model"), [load_suite("arith")], "runs/eval-1", model_dir="runs/model")

Importing this package is cheap: torch and transformers load only when a backend is built.
"""

from lmforge.eval.backends import Backend, MockBackend, TransformerBackend, model_hash
from lmforge.eval.compare import SuiteChangedError, compare_runs
from lmforge.eval.evaluate import evaluate
from lmforge.eval.suites import make_perplexity_suite
from lmforge.tasks.suite import Suite, SuiteError, builtin_names, load_suite

__all__ = ["Backend", "MockBackend", "Suite", "SuiteChangedError", "SuiteError", "TransformerBackend",
           "builtin_names", "compare_runs", "evaluate", "load_suite", "make_perplexity_suite", "model_hash"]
