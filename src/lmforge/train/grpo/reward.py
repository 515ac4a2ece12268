"""Rewards for GRPO: built-in `format` and `correct`, and any `module:function` a user names.

A reward function is `f(completion: str, task: dict) -> float`, where `task` is a task row
(`prompt`, `answer`, `reasoning`, `category`, as `lmforge.data.synth.read_tasks` returns it).
Built-ins use the one reasoning format and extractor (`lmforge.tasks.reasoning`):

    format   1 if the completion is `<think>...</think>` then exactly one `Answer: X` line, else 0
    correct  1 if that one answer line equals the task's answer (1,000 = 1000 = 1000.0), else 0

`Rewards` applies the configured functions with their weights and returns every component per
sample (logged separately) and their weighted sum. Knows nothing about models or tensors.

    rewards = Rewards(["format", "correct", "my_pkg.rewards:brevity"], [1.0, 1.0, 0.1])
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import partial
from typing import Any

from lmforge.config import ConfigError
from lmforge.tasks.reasoning import ReasoningFormat, answers_match

RewardFn = Callable[[str, dict[str, Any]], float]


def format_reward(completion: str, task: dict[str, Any], fmt: ReasoningFormat = ReasoningFormat()) -> float:
    return float(fmt.is_well_formed(completion))


def correct_reward(completion: str, task: dict[str, Any], fmt: ReasoningFormat = ReasoningFormat()) -> float:
    return float(answers_match(fmt.extract(completion), task["answer"]))


def load_reward(spec: str, fmt: ReasoningFormat) -> RewardFn:
    """A built-in name or `package.module:function`."""
    if spec == "format":
        return partial(format_reward, fmt=fmt)
    if spec == "correct":
        return partial(correct_reward, fmt=fmt)
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ConfigError(f"grpo.rewards: {spec!r} is neither 'format', 'correct' nor 'module:function'")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"grpo.rewards: cannot load {spec!r} ({e}); the module must be importable "
                          f"(on PYTHONPATH) and define {name}(completion, task) -> float") from None
    if not callable(fn):
        raise ConfigError(f"grpo.rewards: {spec!r} is not callable")
    return fn


class Rewards:
    def __init__(self, names: list[str], weights: list[float], fmt: ReasoningFormat = ReasoningFormat()):
        self.names, self.weights = list(names), list(weights)
        self.fns = [load_reward(n, fmt) for n in self.names]
        self.fmt = fmt

    def __call__(self, completions: list[str], tasks: list[dict[str, Any]]) -> tuple[dict[str, list[float]], list[float]]:
        """({name: per-sample values}, per-sample weighted totals)."""
        parts = {name: [float(fn(c, t)) for c, t in zip(completions, tasks)] for name, fn in zip(self.names, self.fns)}
        totals = [sum(w * parts[n][i] for n, w in zip(self.names, self.weights)) for i in range(len(completions))]
        return parts, totals

    def accuracy_and_format(self, completions: list[str], tasks: list[dict[str, Any]]) -> tuple[float, float]:
        """Share of correct answers and of well-formed completions (logged whatever rewards are used)."""
        n = max(len(completions), 1)
        acc = sum(correct_reward(c, t, self.fmt) for c, t in zip(completions, tasks)) / n
        fmt = sum(format_reward(c, t, self.fmt) for c, t in zip(completions, tasks)) / n
        return acc, fmt
