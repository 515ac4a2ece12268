"""`--log-requests`: every finished exchange goes to the feedback store from a writer process.

Masking PII is regex work: in the serving process it would hold the GIL the event loop needs (a
writer thread does not help: it shares that GIL). So the masking and the SQLite writes run in a
child interpreter of their own, and the serving process only appends a dict to a list:

    handlers (event loop)          parent thread                          writer process
    add(row) -> pending list  -->  sender: conn.send(rows)  --pipe-->     store.log_exchanges(rows)
    wait_written(id) <-- notify <- sender: conn.recv() = ack  <--pipe--   (masks, then one transaction)

Only masked text reaches the disk: the child calls `FeedbackStore.log_exchanges`, which masks
before its transaction starts; the rows cross a pipe, never a file. Rows collect for up to
`INTERVAL_S` (or `MAX_BATCH` rows) and go as one message, answered by one ack: a pipe round trip
per row would cost the serving process more than masking the row in-process did (measured by
`scripts/bench_ops.py --phases log_cpu`). One batch is in flight at a time.

* **Bounded**: at most `max_pending` rows added and not yet written. Past that, `add` drops the row
  and counts it (`dropped`, exported as `lmforge:exchange_log_dropped_total`): serving never waits
  for the log. A dropped exchange is not in the store, so feedback on its id is a 404.
* **Feedback on a just-finished completion**: `wait_written(id)` has the pending rows sent at once
  (no interval wait) and blocks until the batch holding `id` is committed.
* **Writer death**: the rows it had not acknowledged and everything added later are dropped and
  counted, and the error is logged; serving goes on.

`version_of(id)` remembers which version answered a recent id, for per-version feedback metrics.
Knows nothing about HTTP or the store's schema. The child: `python -m lmforge.serve.exchange_log
CMD_FD ACK_FD DB_PATH` (started by `ExchangeLog`).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import OrderedDict
from multiprocessing.connection import Connection, Pipe
from pathlib import Path

from lmforge.registry import FeedbackStore
from lmforge.tools.procs import Status, StatusKind, ignore_sigint, kill, start_child, stop

log = logging.getLogger("lmforge.serve")
MAX_PENDING, MAX_BATCH, RECENT = 10_000, 512, 100_000
INTERVAL_S = 0.1  # rows collect this long before they are sent, unless a waiter asks for them
START_TIMEOUT_S = 60.0


class ExchangeLog:
    def __init__(self, store: FeedbackStore, max_pending: int = MAX_PENDING):
        """`store`: the `FeedbackStore` to write (the writer process opens its own connection to the file)."""
        self.path, self.max_pending = Path(store.path), max_pending
        self._rows: list[tuple[int, dict]] = []  # (seq, row) added and not yet sent
        self._lock = threading.Condition()
        self._seq = 0  # rows accepted so far; a row's seq is its number among them
        self._written = 0  # every seq <= this is committed (or known lost)
        self.dropped = 0  # rows not stored: the queue was full, or the writer failed
        self._recent: OrderedDict[str, tuple[str, int]] = OrderedDict()  # id -> (version, seq)
        self._closed = False
        self._urgent = False  # a waiter (feedback, flush) wants the rows now
        self._dead: str | None = None
        child_cmd, self._cmd = Pipe(duplex=False)
        self._ack, child_ack = Pipe(duplex=False)
        fds = (child_cmd.fileno(), child_ack.fileno())
        self._proc = start_child(["-m", "lmforge.serve.exchange_log", str(fds[0]), str(fds[1]), str(self.path)], fds)
        child_cmd.close()
        child_ack.close()
        if not self._ack.poll(START_TIMEOUT_S) or self._recv().kind is not StatusKind.READY:
            kill(self._proc)
            raise RuntimeError(f"the exchange-log writer for {self.path} did not start "
                               f"(exit {self._proc.returncode}); the server log has its error")
        self._thread = threading.Thread(target=self._run, name="lmforge-exchange-log", daemon=True)
        self._thread.start()

    # ---- the serving side (event loop) ------------------------------------------------------------------

    def add(self, row: dict) -> bool:
        """Queue one exchange; False (and counted in `dropped`) when the queue is full or the writer died."""
        with self._lock:
            if self._dead is not None or self._closed or self._seq - self._written >= self.max_pending:
                self.dropped += 1
                return False
            self._seq += 1
            self._rows.append((self._seq, row))
            self._recent[row["id"]] = (row["model_version"], self._seq)
            if len(self._recent) > RECENT:
                self._recent.popitem(last=False)
            if len(self._rows) in (1, MAX_BATCH):  # the first row starts the sender's interval; a full batch ends it
                self._lock.notify_all()
            return True

    def version_of(self, id: str) -> str | None:
        with self._lock:
            entry = self._recent.get(id)
        return entry[0] if entry else None

    @property
    def pending(self) -> int:
        with self._lock:
            return self._seq - self._written

    def wait_written(self, id: str, timeout: float = 30.0) -> bool:
        """Block until exchange `id` is committed (True), or it is not one of ours (True at once), or
        `timeout` passes (False)."""
        with self._lock:
            entry = self._recent.get(id)
            if entry is None:
                return True
            return self._wait(entry[1], timeout)

    def flush(self, timeout: float = 30.0) -> bool:
        """Block until everything added so far is committed (or lost and counted)."""
        with self._lock:
            return self._wait(self._seq, timeout)

    def _wait(self, seq: int, timeout: float) -> bool:
        """Under the lock: have the sender send now, and wait until `seq` is written."""
        if self._written < seq:
            self._urgent = True
            self._lock.notify_all()
        return self._lock.wait_for(lambda: self._written >= seq, timeout)

    def close(self) -> None:
        self.flush()
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(timeout=30)
        self._cmd.close()  # the child's recv sees EOF and exits
        stop(self._proc, grace_s=10)

    # ---- the sender thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                # one IPC round trip per batch, not per row: that costs the serving process more than
                # masking a row would (measured: scripts/bench_ops.py --phases log_cpu)
                self._lock.wait_for(lambda: self._rows or self._closed)
                self._lock.wait_for(lambda: self._urgent or self._closed or len(self._rows) >= MAX_BATCH, INTERVAL_S)
                if not self._rows:
                    return
                batch, self._rows = self._rows[:MAX_BATCH], self._rows[MAX_BATCH:]
                self._urgent = bool(self._rows) and self._urgent
            last = batch[-1][0]
            try:
                self._cmd.send([row for _, row in batch])  # pickling a few dicts: microseconds
                reply = self._recv()
            except (OSError, EOFError) as e:
                reply = Status(StatusKind.EXITED, f"{type(e).__name__}: {e}")
            if reply.kind is StatusKind.ERROR:  # a bad batch (a full disk): these rows are lost, the writer goes on
                log.error("could not write %d exchanges to the feedback store: %s", len(batch), reply.detail)
            with self._lock:
                if reply.kind is not StatusKind.OK:
                    self.dropped += len(batch)
                if reply.kind is StatusKind.EXITED:
                    self._writer_died(reply.detail)
                self._written = last
                self._lock.notify_all()
            if self._dead is not None:
                return

    def _recv(self) -> Status:
        """The writer's answer, or `EXITED` with why it can answer no more."""
        try:
            return self._ack.recv()
        except (OSError, EOFError):
            code = self._proc.poll()
            return Status(StatusKind.EXITED,
                          f"the writer process exited ({code})" if code is not None else "the pipe closed")

    def _writer_died(self, why: str) -> None:
        """Under the lock: count what can never be written, and release every waiter."""
        self._dead = why
        self.dropped += len(self._rows)
        self._rows = []
        self._written = self._seq
        log.error("the exchange-log writer stopped (%s); exchanges are no longer stored", why)


def writer_main(cmd: Connection, ack: Connection, path: str) -> None:
    """The writer process: batches in, masked rows into the store, one ack per batch. Exits when the
    parent closes its end (EOF)."""
    ignore_sigint()
    store = FeedbackStore(path)
    ack.send(Status(StatusKind.READY))
    while True:
        try:
            rows = cmd.recv()
        except (EOFError, OSError):
            return
        try:
            store.log_exchanges(rows)
            ack.send(Status(StatusKind.OK, len(rows)))
        except Exception as e:  # noqa: BLE001 - reported to the parent, which logs it and counts the rows
            ack.send(Status(StatusKind.ERROR, f"{type(e).__name__}: {e}"))


if __name__ == "__main__":
    writer_main(Connection(int(sys.argv[1])), Connection(int(sys.argv[2])), sys.argv[3])
