"""The model versions one server serves, and how requests are routed between them.

* `Served`: one version (its engine, what the handlers derive from it once: tokenizer, context,
  the longest token, control-token strings, the requests in flight on it), restarted by the
  watchdog when its engine dies.
* `Router`: the champion and, with a canary, the challenger. `route(user)` picks a version by
  weight; with a `user` the pick is a stable hash of it, so a user never switches version mid-session
  (unless the challenger is rolled back, which sends everyone to the champion). The endpoints only
  ever see the `Served` they were given: they do not know how many versions there are.
* `CanaryGuard`: per-version windows of request outcomes and feedback scores. When the challenger's
  error rate or low-score ratio exceeds the champion's by `margin` over at least `min_samples`,
  its weight drops to 0 (an automatic rollback): logged, counted in /metrics, and handed to
  `on_rollback` (which records it in the registry). Scores count per exchange, the latest one only
  (the feedback store's rule): a client that scores one completion 25 times moves one sample, not 25.

Knows nothing about HTTP, the registry's schema or the engine's internals.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from .guard import max_chars_per_token

log = logging.getLogger("lmforge.serve")


class Served:
    """One model version: its engine and what is derived from it once."""

    def __init__(self, role: str, label: str, engine, loader: Callable | None = None, path: str | None = None):
        self.role, self.label, self.loader, self.path = role, label, loader, path
        self.inflight: set[str] = set()  # engine request ids on this version
        self.restarts = 0
        self.down: str | None = None  # why its engine is not serving (restarting after a crash)
        self.fatal: str | None = None  # died more often than allowed
        self._token_text: dict[int, str] = {}
        self.attach(engine)

    def attach(self, engine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.vocab_size
        self.model_dir = engine.model_path
        self.chars_per_token, self.specials = 1, []
        if self.tokenizer is not None:
            self.chars_per_token = max_chars_per_token(self.tokenizer)
            specials = set(getattr(self.tokenizer, "added_tokens_encoder", {})) | set(self.tokenizer.all_special_tokens)
            self.specials = sorted((t for t in specials if t), key=len, reverse=True)
        self._token_text.clear()
        self.down = None

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.is_running and self.fatal is None

    def token_text(self, token_id: int) -> str:
        """Decoded text of one token, for logprobs (cached: the same ids recur constantly)."""
        s = self._token_text.get(token_id)
        if s is None:
            s = self._token_text[token_id] = self.tokenizer.decode([token_id]) if self.tokenizer else str(token_id)
        return s

    def stats(self) -> dict | None:
        return self.engine.stats() if self.engine is not None else None


def _bucket(user: str) -> float:
    """A user's fixed point in [0, 100): the same user lands on the same side of any split."""
    return int.from_bytes(hashlib.sha256(user.encode()).digest()[:8], "big") / 2**64 * 100


class Router:
    """champion (+ challenger at `canary_percent`); sticky per user."""

    def __init__(self, champion: Served, challenger: Served | None = None, canary_percent: float = 0.0,
                 seed: int = 0):
        self.champion, self.challenger = champion, challenger
        self.canary_percent = canary_percent if challenger is not None else 0.0
        self._rng = random.Random(seed)
        self.rolled_back: str | None = None  # why the challenger lost its traffic

    def versions(self) -> list[Served]:
        return [v for v in (self.champion, self.challenger) if v is not None]

    def route(self, user: str | None) -> Served:
        if self.challenger is None or self.canary_percent <= 0 or not self.challenger.ready:
            return self.champion
        point = _bucket(user) if user else self._rng.random() * 100
        return self.challenger if point < self.canary_percent else self.champion

    def replace(self, role: str, served: Served | None) -> Served | None:
        """Swap the version in `role`; returns the one it replaces (to drain)."""
        old = getattr(self, role)
        setattr(self, role, served)
        if role == "challenger":
            self.rolled_back = None
        return old


@dataclass
class _Window:
    outcomes: deque = field(default_factory=lambda: deque(maxlen=200))  # True = failed (5xx)
    scores: OrderedDict = field(default_factory=OrderedDict)  # exchange id -> its latest score is low


class CanaryGuard:
    """Automatic rollback of the challenger on errors or low feedback scores."""

    def __init__(self, router: Router, margin: float = 0.1, min_samples: int = 20, window: int = 200,
                 on_rollback: Callable[[str, dict], None] | None = None):
        self.router, self.margin, self.min_samples = router, margin, min_samples
        self.on_rollback = on_rollback
        self._w: dict[str, _Window] = {}
        self.window = window
        self.rollbacks = 0
        self._anonymous = itertools.count()  # keys for scores given without an exchange id

    def _of(self, label: str) -> _Window:
        w = self._w.get(label)
        if w is None:
            w = self._w[label] = _Window(deque(maxlen=self.window))
        return w

    def outcome(self, label: str, failed: bool) -> None:
        self._of(label).outcomes.append(failed)
        self._check("error_rate", lambda w: w.outcomes)

    def score(self, label: str, low: bool, exchange_id: str | None = None) -> None:
        """The latest score of exchange `exchange_id` (answered by `label`) replaces its earlier one;
        the window keeps the `window` most recently scored exchanges."""
        scores = self._of(label).scores
        key = exchange_id if exchange_id is not None else next(self._anonymous)
        scores.pop(key, None)
        scores[key] = low
        if len(scores) > self.window:
            scores.popitem(last=False)
        self._check("low_score_ratio", lambda w: w.scores.values())

    def _check(self, what: str, series: Callable[[_Window], Collection[bool]]) -> None:
        r = self.router
        if r.challenger is None or r.canary_percent <= 0:
            return
        champ, chal = series(self._of(r.champion.label)), series(self._of(r.challenger.label))
        if len(chal) < self.min_samples or len(champ) < self.min_samples:
            return
        rate_chal, rate_champ = sum(chal) / len(chal), sum(champ) / len(champ)
        if rate_chal - rate_champ > self.margin:
            details = {"metric": what, "challenger": r.challenger.label, "champion": r.champion.label,
                       "challenger_rate": round(rate_chal, 4), "champion_rate": round(rate_champ, 4),
                       "margin": self.margin, "samples": [len(chal), len(champ)], "time": time.time()}
            r.canary_percent = 0.0
            r.rolled_back = f"{what} {rate_chal:.3f} vs {rate_champ:.3f} (margin {self.margin})"
            self.rollbacks += 1
            log.warning("automatic rollback: challenger %s %s; all traffic back to champion %s",
                        r.challenger.label, r.rolled_back, r.champion.label)
            if self.on_rollback is not None:
                try:
                    self.on_rollback("auto_rollback", details)
                except Exception:  # the registry being unreachable must not break serving
                    log.exception("could not record the automatic rollback")
