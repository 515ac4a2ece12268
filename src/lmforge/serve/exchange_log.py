"""`--log-requests`: every finished exchange goes to the feedback store, off the request path.

Handlers `add()` a row (a dict append under a lock); a writer thread hands batches to
`FeedbackStore.log_exchanges` (one transaction per batch; the store masks PII before writing), so
logging costs the serving path almost nothing. `flush()` waits until everything added so far is
written (the feedback endpoint calls it, so feedback on a just-finished completion finds its row).
`version_of(id)` remembers which version answered a recent id, for per-version feedback metrics.
Knows nothing about HTTP or the store's schema.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

log = logging.getLogger("lmforge.serve")
BATCH, INTERVAL_S, RECENT = 512, 0.2, 100_000


class ExchangeLog:
    def __init__(self, store):
        self.store = store
        self._rows: list[dict] = []
        self._lock = threading.Condition()
        self._added = self._written = 0
        self._recent: OrderedDict[str, str] = OrderedDict()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="lmforge-exchange-log", daemon=True)
        self._thread.start()

    def add(self, row: dict) -> None:
        with self._lock:
            self._rows.append(row)
            self._added += 1
            self._recent[row["id"]] = row["model_version"]
            if len(self._recent) > RECENT:
                self._recent.popitem(last=False)
            if len(self._rows) >= BATCH:
                self._lock.notify_all()

    def version_of(self, id: str) -> str | None:
        with self._lock:
            return self._recent.get(id)

    def flush(self, timeout: float = 30.0) -> None:
        with self._lock:
            target = self._added
            self._lock.notify_all()
            self._lock.wait_for(lambda: self._written >= target or self._closed, timeout)

    def close(self) -> None:
        self.flush()
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._rows or self._closed, INTERVAL_S)
                if self._closed and not self._rows:
                    return
                rows, self._rows = self._rows, []
            if rows:
                try:
                    self.store.log_exchanges(rows)
                except Exception:  # a full disk must not take serving down; the log says what was lost
                    log.exception("could not write %d exchanges to the feedback store", len(rows))
            with self._lock:
                self._written += len(rows)
                self._lock.notify_all()
