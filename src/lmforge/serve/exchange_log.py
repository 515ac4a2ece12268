"""`--log-requests`: every finished exchange goes to the feedback store from a writer process.

Masking PII is regex work: in the serving process it would hold the GIL the event loop needs (a
writer thread does not help: it shares that GIL). So the masking and the SQLite writes run in a
child interpreter of their own, and the serving process only appends a dict to a list:

    handlers (event loop)          parent threads                         writer process
    add(row) -> pending list  -->  sender: conn.send(rows)  --pipe-->     store.log_exchanges(rows)
    wait_written(id) <-- notify <- acker: conn.recv() = ack  <--pipe--    (masks, then one transaction)

Only masked text reaches the disk: the child calls `FeedbackStore.log_exchanges`, which masks
before its transaction starts; the rows cross a pipe, never a file. A chat's row carries its message
list as `prompt` (the store keeps it as messages, each masked on its own, so the flywheel trains on
turns with their roles); a completion's, its text. A row is added before its
response is sent, and rows go to the pipe at most `interval_s` (default `INTERVAL_S`, 50 ms) after
they are added: at once after a quiet spell, else with the next batch (at most one batch per
interval, or sooner when `MAX_BATCH` have collected or a waiter asks): one message per batch,
answered by one ack, and the sender does not wait for a batch's ack before it sends the next (a row
held back until the writer caught up would die with the server). The interval trades the crash
window for the serving process's CPU: each batch costs a pipe message, an ack and two thread
wake-ups, so at 100 exchanges/s `scripts/bench_ops.py --phases log_cpu` measured ~160 us of it per
exchange with a 10 ms interval (one row per batch), ~140 us at 25 ms and ~80 us at 50 ms
(2026-12-02, a busy 2-core box). The writer commits each batch it reads (batches that queued while
it was busy go in one transaction).

* **What a crash can lose** (docs/operations.md, "Request logging"): nothing answered (see "Durable
  before answered" below), unless the writer was stuck past `DURABLE_TIMEOUT_S`. A row that is in the
  pipe is the writer's: it reads the pipe to its end and commits every row in it even after the server
  is killed with SIGKILL, then exits; rows not yet handed over (an answer that timed out waiting, or
  rows the sender could not write because the writer is more than a pipe buffer behind: the buffer is
  raised to `PIPE_BYTES`, 1 MiB, about 1,900 rows of 450 characters) die with the server. A kill of the writer itself loses the batches it had read and not committed
  (counted as dropped). Commits use SQLite's `synchronous=NORMAL` under WAL: a process crash loses
  nothing committed; a power cut can lose the last commits, never the file.
* **Bounded**: at most `max_pending` rows added and not yet acknowledged. Past that, `add` drops the
  row and counts it (`dropped`, exported as `lmforge:exchange_log_dropped_total`): serving never
  waits for the log. A dropped exchange is not in the store, so feedback on its id is a 404.
* **Durable before answered** (issue 43): the endpoints `await committed(id)` before the last byte of
  an answer goes out (a JSON body; a stream's `[DONE]`): the row is sent at once (no interval wait)
  and the answer waits for the writer's commit of its batch, so an exchange a client saw answered is
  in the store whatever is killed afterwards (before: up to 2 of 60 lost to a `kill -9` right after
  the answer). Concurrent answers share a batch and a commit. The wait is bounded
  (`DURABLE_TIMEOUT_S`): a writer that is stuck or gone never holds answers longer (the row stays
  queued, or is counted as dropped, as above).
* **Feedback on a just-finished completion**: `wait_written(id)` has the pending rows sent at once
  (no interval wait) and blocks until the batch holding `id` is committed.
* **Writer death** (killed, OOM): the batches it had read and not acknowledged are counted as
  dropped (it may have committed some of them; the count errs on the side of "lost"), and a new
  writer is started for the rows still queued and those to come, up to `max_restarts` times
  (`MAX_RESTARTS`); after that every row is dropped and counted. Serving goes on either way.

`version_of(id)` remembers which version answered a recent id, for per-version feedback metrics.
Knows nothing about HTTP or the store's schema. The child: `python -m lmforge.serve.exchange_log
CMD_FD ACK_FD DB_PATH` (started by `ExchangeLog`).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import sys
import threading
import time
from collections import OrderedDict, deque
from multiprocessing.connection import Connection, Pipe
from pathlib import Path

from lmforge.registry import FeedbackStore
from lmforge.tools.procs import Status, StatusKind, ignore_sigint, kill, start_child, stop

log = logging.getLogger("lmforge.serve")
MAX_PENDING, MAX_BATCH, RECENT = 10_000, 512, 100_000
INTERVAL_S = 0.05  # the longest a row waits in this process before it goes to the writer (see the docstring)
PIPE_BYTES = 1 << 20  # Linux's default cap for an unprivileged process (/proc/sys/fs/pipe-max-size)
START_TIMEOUT_S = 60.0
DURABLE_TIMEOUT_S = 5.0  # the longest an answer waits for its exchange's commit before it goes out anyway
MAX_RESTARTS = 5  # writers started again after one dies (a kill, an OOM), before the log gives up


class ExchangeLog:
    def __init__(self, store: FeedbackStore, max_pending: int = MAX_PENDING, interval_s: float = INTERVAL_S,
                 max_restarts: int = MAX_RESTARTS):
        """`store`: the `FeedbackStore` to write (the writer process opens its own connection to the file).
        `interval_s`: how long rows may collect before they are sent (0: at once). `max_restarts`: writers
        started again after one dies, before the log gives up (then every row is dropped and counted)."""
        if not 0 <= interval_s <= 1:
            raise ValueError(f"exchange log interval_s={interval_s!r}: must be in [0, 1] seconds")
        self.path, self.max_pending, self.interval_s = Path(store.path), max_pending, interval_s
        self._rows: list[tuple[int, dict]] = []  # (seq, row) added and not yet sent
        self._last_sent = 0.0  # when the sender last sent a batch (time.monotonic)
        self._in_flight: deque[tuple[int, int]] = deque()  # (last seq, rows) of batches sent, not acked
        self._lock = threading.Condition()
        self._seq = 0  # rows accepted so far; a row's seq is its number among them
        self._written = 0  # every seq <= this is committed (or known lost)
        self.dropped = 0  # rows not stored: the queue was full, or the writer failed
        self._recent: OrderedDict[str, tuple[str, int]] = OrderedDict()  # id -> (version, seq)
        self._closed = False
        self._urgent = False  # a waiter (feedback, flush) wants the rows now
        self._dead: str | None = None  # why no writer will come back (restarts spent, or closed)
        self.restarts, self.max_restarts = 0, max_restarts
        self._generation = 0  # which writer the threads serve: a death report of an older one is stale
        self._waiters: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future]] = []  # (seq, loop, future)
        self._start_writer()

    def _start_writer(self) -> None:
        """A writer process, its pipes and the sender + acker threads serving it (generation + 1)."""
        child_cmd, cmd = Pipe(duplex=False)
        ack, child_ack = Pipe(duplex=False)
        _grow_pipe(cmd)
        fds = (child_cmd.fileno(), child_ack.fileno())
        proc = start_child(["-m", "lmforge.serve.exchange_log", str(fds[0]), str(fds[1]), str(self.path)], fds)
        child_cmd.close()
        child_ack.close()
        if not ack.poll(START_TIMEOUT_S) or _recv(ack, proc).kind is not StatusKind.READY:
            kill(proc)
            raise RuntimeError(f"the exchange-log writer for {self.path} did not start "
                               f"(exit {proc.returncode}); the server log has its error")
        with self._lock:
            self._cmd, self._ack, self._proc = cmd, ack, proc
            self._generation += 1
            gen = self._generation
            self._lock.notify_all()
        self._sender = threading.Thread(target=self._send_loop, args=(gen,), name="lmforge-exchange-log", daemon=True)
        self._acker = threading.Thread(target=self._ack_loop, args=(gen,), name="lmforge-exchange-log-acks",
                                       daemon=True)
        self._sender.start()
        self._acker.start()

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
            if len(self._rows) in (1, MAX_BATCH):  # the first row wakes the sender; a full batch ends its wait
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

    async def committed(self, id: str, timeout: float = DURABLE_TIMEOUT_S) -> bool:
        """On the event loop: wait until exchange `id` is committed, or known lost, or not one of ours (True);
        False after `timeout`. Its row is sent at once, not after the interval."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            entry = self._recent.get(id)
            if entry is None or self._written >= entry[1]:
                return True
            self._waiters.append((entry[1], loop, future))
            self._urgent = True
            self._lock.notify_all()
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            return False

    def _wake_waiters(self) -> None:
        """Under the lock: resolve the `committed` waiters whose rows are written (or lost)."""
        if not self._waiters:
            return
        ready = [w for w in self._waiters if w[0] <= self._written]
        self._waiters = [w for w in self._waiters if w[0] > self._written]
        for _, loop, future in ready:
            loop.call_soon_threadsafe(_resolve, future)

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
        self._sender.join(timeout=30)
        self._cmd.close()  # the child's recv sees EOF, commits what it read, and exits
        stop(self._proc, grace_s=10)
        self._acker.join(timeout=30)

    # ---- the sender and acker threads -------------------------------------------------------------------

    def _send_loop(self, gen: int) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._rows or self._closed or self._dead or gen != self._generation)
                if gen != self._generation:  # this writer died: the next one has its own sender
                    return
                # at most one batch per interval: after a quiet spell a row goes at once, in a burst rows
                # collect (each waits less than the interval, since the last batch went before it came)
                self._lock.wait_for(lambda: self._urgent or self._closed or self._dead or len(self._rows) >= MAX_BATCH
                                    or gen != self._generation, self._last_sent + self.interval_s - time.monotonic())
                if not self._rows or self._dead or gen != self._generation:
                    return
                batch, self._rows = self._rows[:MAX_BATCH], self._rows[MAX_BATCH:]  # an overflow goes next
                self._last_sent = time.monotonic()
                self._urgent = bool(self._rows) and self._urgent
                self._in_flight.append((batch[-1][0], len(batch)))
            try:
                # pickling a few dicts: microseconds; blocks only when the writer is a full pipe behind
                self._cmd.send([row for _, row in batch])
            except (OSError, ValueError) as e:  # the writer is gone (or close() raced a failing writer)
                with self._lock:
                    self._writer_died(gen, f"could not send to the writer: {type(e).__name__}: {e}")
                return

    def _ack_loop(self, gen: int) -> None:
        """One ack per batch, in the order the batches were sent."""
        ack, proc = self._ack, self._proc
        while True:
            reply = _recv(ack, proc)
            with self._lock:
                if self._dead is not None or gen != self._generation:  # already counted by the sender
                    return
                if reply.kind is StatusKind.EXITED:
                    if not (self._closed and not self._in_flight):  # not the EOF of a clean close
                        self._writer_died(gen, reply.detail)
                    self._lock.notify_all()
                    return
                last, n = self._in_flight.popleft()
                if reply.kind is not StatusKind.OK:  # a bad batch (a full disk): these rows are lost, the writer goes on
                    log.error("could not write %d exchanges to the feedback store: %s", n, reply.detail)
                    self.dropped += n
                self._written = last
                self._wake_waiters()
                self._lock.notify_all()

    def _writer_died(self, gen: int, why: str) -> None:
        """Under the lock, once per writer: the batches it held are counted lost (it may have committed
        some: the count errs on the side of "lost"), and a new writer is started for the rows still
        queued and those to come; after `max_restarts` the log gives up and drops (and counts) them."""
        if self._dead is not None or gen != self._generation:
            return
        self._generation += 1  # retire this writer's threads
        if self._in_flight:
            self.dropped += sum(n for _, n in self._in_flight)
            self._written = self._in_flight[-1][0]
            self._in_flight.clear()
        old = self._proc
        if self._closed or self.restarts >= self.max_restarts:
            self._dead = why
            self.dropped += len(self._rows)
            self._rows = []
            self._written = self._seq
            log.error("the exchange-log writer stopped (%s); exchanges are no longer stored", why)
        else:
            self.restarts += 1
            log.error("the exchange-log writer stopped (%s); starting another (restart %d of %d)", why,
                      self.restarts, self.max_restarts)
            threading.Thread(target=self._restart, args=(old,), name="lmforge-exchange-log-restart",
                             daemon=True).start()
        self._wake_waiters()  # the rows it held are counted lost: their answers need not wait
        self._lock.notify_all()

    def _restart(self, old) -> None:
        kill(old)
        try:
            self._start_writer()
        except Exception as e:  # noqa: BLE001 - a writer that cannot start: give up, count, keep serving
            with self._lock:
                self.restarts = self.max_restarts
                self._writer_died(self._generation, f"a new writer did not start: {e}")


def _resolve(future: asyncio.Future) -> None:
    if not future.done():  # its waiter may have timed out (then it was cancelled)
        future.set_result(True)


def _recv(ack: Connection, proc) -> Status:
    """The writer's answer, or `EXITED` with why it can answer no more."""
    try:
        return ack.recv()
    except (OSError, EOFError):
        code = proc.poll()
        return Status(StatusKind.EXITED, f"the writer process exited ({code})" if code is not None else "the pipe closed")


def _grow_pipe(conn: Connection) -> None:
    """Raise the pipe's buffer to PIPE_BYTES (Linux): what sits in the pipe survives a crash of the
    server, what waits in this process does not."""
    try:
        fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (AttributeError, OSError):  # not Linux, or a lower pipe-max-size: the default 64 KiB buffer
        pass


def writer_main(cmd: Connection, ack: Connection, path: str) -> None:
    """The writer process: batches in, masked rows into the store, one ack per batch. Batches that
    queued while it was busy go in one transaction. It reads the pipe to its end (EOF) before it
    exits, also when the server died (then there is nobody to ack)."""
    ignore_sigint()
    store = FeedbackStore(path)
    ack.send(Status(StatusKind.READY))
    acks: Connection | None = ack  # None once the server is gone
    eof = False
    while not eof:
        batches = []
        try:
            batches.append(cmd.recv())
            while cmd.poll(0) and sum(map(len, batches)) < MAX_BATCH:
                batches.append(cmd.recv())
        except (EOFError, OSError):  # the server closed its end (or died): write what was read, then exit
            eof = True
        if not batches:
            return
        try:
            store.log_exchanges([row for b in batches for row in b])
            replies = [Status(StatusKind.OK, len(b)) for b in batches]
        except Exception:  # noqa: BLE001 - retried batch by batch, so a bad batch loses only its own rows
            replies = [_write_one(store, b) for b in batches]
        for reply in replies:
            try:
                if acks is not None:
                    acks.send(reply)
            except OSError:  # the server died: keep committing what it handed over, until EOF
                acks = None


def _write_one(store: FeedbackStore, rows: list[dict]) -> Status:
    try:
        store.log_exchanges(rows)
        return Status(StatusKind.OK, len(rows))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which logs it and counts the rows
        return Status(StatusKind.ERROR, f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    writer_main(Connection(int(sys.argv[1])), Connection(int(sys.argv[2])), sys.argv[3])
