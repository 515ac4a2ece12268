"""Progress of a long verb: a bar on a terminal, one line every few seconds otherwise.

One helper for every verb that runs for more than a few seconds (`data prepare`, `eval`, `generate`,
`bench data`, `bench spec-decode`, ...): how many of how many, the rate and the time left. On a
terminal (the stream is a TTY) it redraws one line in place, at most ten times a second; anywhere
else (a log file, CI, a pipe) it prints one plain line every `every_s` seconds (default 5, or
`LMFORGE_PROGRESS_S`) and one when it closes, so a job that runs for minutes is never silent and its
log stays readable. `LMFORGE_PROGRESS=off` silences it, `=lines` forces lines on a terminal.
It knows nothing about what it counts; it writes to stderr, so stdout stays the verb's result.

    with Progress("generate", total=500, unit="req") as p:
        for batch in batches:
            ...
            p.advance(len(batch))

    generate: 128/500 req (26%), 12.3 req/s, 10s elapsed, ETA 30s      <- the line form
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import TextIO

MIN_REDRAW_S = 0.1  # a terminal bar redraws at most this often
BAR_WIDTH = 24


def fmt_duration(seconds: float) -> str:
    """42s, 3m05s, 1h02m: short enough for a progress line, exact enough for an ETA."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def eta_s(done: float, total: float | None, elapsed: float) -> float | None:
    """Seconds left at the rate so far; None while nothing is done or the total is unknown."""
    if not total or done <= 0 or elapsed <= 0:
        return None
    return max(0.0, (total - done) * elapsed / done)


class StepClock:
    """The ETA of a loop of steps (training): from the steps this process ran (a resumed run's earlier
    steps are not in its rate), evaluation and checkpoint time included, as a person waits for them."""

    def __init__(self, step: int, max_steps: int):
        self.t0, self.step0, self.max_steps = time.monotonic(), step, max_steps

    def eta(self, step: int) -> str:
        """`ETA 3m05s` (`done in ...` at the last step), for the step log line."""
        elapsed = time.monotonic() - self.t0
        if step >= self.max_steps:
            return f"done in {fmt_duration(elapsed)}"
        left = eta_s(step - self.step0, self.max_steps - self.step0, elapsed)
        return f"ETA {fmt_duration(left)}" if left is not None else "ETA ?"


class Progress:
    def __init__(self, desc: str, total: float | None = None, unit: str = "it", *, stream: TextIO | None = None,
                 every_s: float | None = None, enabled: bool = True, heartbeat: bool = False, initial: float = 0):
        """`total`: None while unknown (set `p.total` later). `initial`: already done before this run (a
        resumed job): counted in done, not in the rate. `every_s`: seconds between lines off a
        terminal. `heartbeat`: a thread also prints when nothing advanced for `every_s` (the elapsed time
        moves), for work whose count moves in large steps. `enabled=False` (or LMFORGE_PROGRESS=off)
        makes every call a no-op."""
        self.desc, self.total, self.unit = desc, total, unit
        self.stream = stream if stream is not None else sys.stderr
        mode = os.environ.get("LMFORGE_PROGRESS", "auto")
        self.enabled = enabled and mode != "off"
        self.bar = self.enabled and mode != "lines" and _isatty(self.stream)
        self.every_s = every_s if every_s is not None else float(os.environ.get("LMFORGE_PROGRESS_S", "5"))
        self.done, self.initial, self.postfix = float(initial), float(initial), ""
        self.t0 = time.monotonic()
        self._last_out = self.t0
        self._lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        if heartbeat and self.enabled:
            threading.Thread(target=self._beat, name=f"progress-{desc}", daemon=True).start()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def advance(self, n: float = 1) -> None:
        self.update(self.done + n)

    def update(self, done: float, postfix: str | None = None) -> None:
        """Set the count (and the text shown after it); prints when a line or a redraw is due."""
        with self._lock:
            self.done = done
            if postfix is not None:
                self.postfix = postfix
            now = time.monotonic()
            due = MIN_REDRAW_S if self.bar else self.every_s
            if self.enabled and not self._closed and now - self._last_out >= due:
                self._last_out = now
                self._write(now)

    def close(self) -> None:
        """The final line (count, rate, time taken); a bar ends its line."""
        self._stop.set()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.enabled:
                self._write(time.monotonic(), final=True)

    def _beat(self) -> None:
        period = 1.0 if self.bar else max(self.every_s, 0.05)
        while not self._stop.wait(period):
            with self._lock:
                now = time.monotonic()
                if not self._closed and now - self._last_out >= (period if self.bar else self.every_s):
                    self._last_out = now
                    self._write(now)

    def line(self, now: float | None = None, final: bool = False) -> str:
        """`desc: done/total unit (pct%), rate unit/s, elapsed, ETA` (at the end: `in` the time taken)."""
        elapsed = (now or time.monotonic()) - self.t0
        count = f"{_num(self.done)}/{_num(self.total)}" if self.total else _num(self.done)
        parts = [f"{self.desc}: {count} {self.unit}"]
        if self.total:
            parts[0] += f" ({100 * min(self.done / self.total, 1):.0f}%)"
        new = self.done - self.initial
        if elapsed > 0 and new:
            parts.append(f"{new / elapsed:.3g} {self.unit}/s")
        if final:
            parts.append(f"done in {fmt_duration(elapsed)}")
        else:
            parts.append(f"{fmt_duration(elapsed)} elapsed")
            left = eta_s(new, self.total - self.initial if self.total else None, elapsed)
            parts.append(f"ETA {fmt_duration(left)}" if left is not None else "ETA ?")
        if self.postfix:
            parts.append(self.postfix)
        return ", ".join(parts)

    def _write(self, now: float, final: bool = False) -> None:
        text = self.line(now, final)
        if self.bar:
            share = min(self.done / self.total, 1.0) if self.total else 0.0
            fill = int(BAR_WIDTH * share)
            text = f"\r[{'#' * fill}{'.' * (BAR_WIDTH - fill)}] {text}\x1b[K" + ("\n" if final else "")
        else:
            text += "\n"
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed pipe must not stop the work it reports on
            self.enabled = False


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _num(x: float | None) -> str:
    if x is None:
        return "?"
    return f"{int(x):,}" if float(x).is_integer() else f"{x:,.1f}"
