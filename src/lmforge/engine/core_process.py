"""`ProcessAsyncLLMEngine`: `AsyncLLMEngine` with the `LLMEngine` in a child process (vLLM V1's
"engine core" split), for the HTTP server.

Why a process: in one process the engine's step loop and the server's event loop share the GIL.
Every torch op releases it; when the loop holds it (turning a step's outputs into SSE chunks), the
stepping thread waits for each op's re-acquisition, so the loop's Python work stalls the forward
instead of running beside it on the other core. With the engine in its own process the two run in
parallel and only pickled messages cross.

    parent (event loop)            parent threads                  child process
    generate()/abort() --queue-->  sender:   conn.send(command) --> apply commands, step()
    per-request asyncio.Queue <--  receiver: conn.recv(batch)  <-- (replies, outputs, stats)

Commands and their replies keep their order (one pipe each way); a batch carries the replies to the
commands applied since the last one, the outputs of one step and a stats snapshot taken after it,
so `stats()` already shows an abort's blocks freed when `abort()` returns. The child ignores SIGINT
(the parent decides when to stop), exits when the parent goes away, and if it dies every request
in flight gets an `EngineDeadError` naming the cause (exit code or signal). With tensor parallelism the
child starts the worker ranks (`executor.py`); one that dies ends the child with exit code 1, so the
server can restart the engine instead of failing every later step. The public surface is
`AsyncLLMEngine`'s; `generate()` and `abort()` are inherited unchanged. Knows nothing about HTTP.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from typing import Any

from .async_engine import (AsyncLLMEngine, Batches, EngineDeadError, EngineStepError, Sink, _resolve, post_batches,
                           route_outputs)
from .config import EngineConfig
from .executor import WorkerDiedError
from lmforge.tokenizer.load import load_tokenizer

LOAD_TIMEOUT_S = 600.0


class ProcessAsyncLLMEngine(AsyncLLMEngine):
    def __init__(self, config: EngineConfig):  # noqa: super().__init__ would build an in-process engine
        self.engine = None  # lives in the child
        # A plain child interpreter (not multiprocessing's spawn, which re-imports the caller's
        # __main__ and so breaks any script without an `if __name__ == "__main__"` guard).
        child_cmd_recv, self._cmd_send = Pipe(duplex=False)
        self._out_recv, child_out_send = Pipe(duplex=False)
        fds = (child_cmd_recv.fileno(), child_out_send.fileno())
        self._proc = subprocess.Popen(
            [sys.executable, "-c", f"from lmforge.engine.core_process import child_main; child_main({fds[0]}, {fds[1]})"],
            pass_fds=fds, stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": _pythonpath()})
        child_cmd_recv.close()
        child_out_send.close()
        self._stopped = False
        self._dead: BaseException | None = None
        self._lock = threading.Lock()  # guards _sinks and _pending: the event loop and the receiver use them
        self._sinks: dict[str, Sink] = {}
        self._pending: dict[int, asyncio.Future | None] = {}
        self._ids = itertools.count()
        try:
            torch = sys.modules.get("torch")  # the child computes with the threads this process was given
            self._cmd_send.send((config, os.getpid(), torch.get_num_threads() if torch else None))
        except OSError:
            pass  # the child died at start: _wait_ready says so
        kind, info = self._wait_ready()
        if kind != "ready":
            self._kill()
            raise info
        self._info, self._stats = info, info["stats"]
        self._tokenizer = load_tokenizer(Path(config.model), optional=True)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="lmforge-engine-send", daemon=True)
        self._receiver = threading.Thread(target=self._recv_loop, name="lmforge-engine-recv", daemon=True)
        self._sender.start()
        self._receiver.start()

    def _wait_ready(self) -> tuple[str, Any]:
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._out_recv.poll(0.2):
                try:
                    return self._out_recv.recv()
                except EOFError:
                    break
            if self._proc.poll() is not None:
                break
        self._kill()
        return "error", EngineDeadError(f"the engine process exited while loading ({exit_cause(self._proc.returncode)})")

    def _kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait(timeout=10)

    # ---- what the server reads -----------------------------------------------------------------------

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._info["max_model_len"]

    @property
    def vocab_size(self) -> int:
        return self._info["vocab_size"]

    @property
    def model_path(self) -> str:
        return self._info["model_path"]

    @property
    def is_running(self) -> bool:
        return not self._stopped and self._dead is None and self._proc.poll() is None

    @property
    def dead_reason(self) -> str | None:
        """Why the engine is gone (None while it runs), readable as soon as the process has exited,
        before the receiver thread has failed the requests in flight."""
        if self._dead is not None:
            return str(self._dead)
        code = self._proc.poll()
        return None if code is None else f"the engine process exited ({exit_cause(code)})"

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    # ---- commands ------------------------------------------------------------------------------------

    def _submit(self, kind: str, request_id: str, payload: Any, done: asyncio.Future | None) -> None:
        if self._stopped:
            raise EngineDeadError("AsyncLLMEngine is shut down")
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        cid = next(self._ids)
        with self._lock:
            self._pending[cid] = done
            if kind == "add":
                prompt, params, arrival_time, sink = payload
                self._sinks[request_id] = sink
                payload = (prompt, params, arrival_time)
        self._outbox.put((kind, cid, request_id, payload))

    def _send_loop(self) -> None:
        """Sends never block the event loop: a full pipe (the child mid-step) waits here instead."""
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            try:
                self._cmd_send.send(msg)
            except (OSError, ValueError):  # the child is gone; the receiver reports it
                return

    def _recv_loop(self) -> None:
        while True:
            try:
                msg = self._out_recv.recv()
            except (EOFError, OSError):
                self._on_exit()
                return
            if msg[0] == "batch":
                self._on_batch(*msg[1:])
            elif msg[0] == "closed":
                self._on_exit()
                return

    def _on_batch(self, replies: list, outputs: list, stats: dict) -> None:
        self._stats = stats  # first: a finished or aborted request sees its blocks freed
        batches: Batches = {}
        with self._lock:
            for kind, cid, rid, result in replies:
                done = self._pending.pop(cid, None)
                if kind == "added":
                    if result is not None:  # refused: its caller raises the error
                        self._sinks.pop(rid, None)
                    _resolve(done, result)
                elif kind == "aborted":
                    sink = self._sinks.pop(rid, None)
                    if sink is not None and result is not None:
                        batches.setdefault(sink[0], []).append((sink[1], result))
                    _resolve(done, None)
                elif kind == "failed":  # a step raised: every request in flight gets the error
                    for failed in rid:
                        sink = self._sinks.pop(failed, None)
                        if sink is not None:
                            batches.setdefault(sink[0], []).append((sink[1], result))
            route_outputs(self._sinks, outputs, batches)
        post_batches(batches)

    def _on_exit(self) -> None:
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        error = EngineDeadError("AsyncLLMEngine shut down" if self._stopped else
                                f"the engine process exited ({exit_cause(self._proc.returncode)})")
        self._dead = error
        with self._lock:
            sinks, pending = list(self._sinks.values()), list(self._pending.values())
            self._sinks.clear()
            self._pending.clear()
        for loop, q in sinks:
            try:
                loop.call_soon_threadsafe(q.put_nowait, error)
            except RuntimeError:
                pass
        for done in pending:
            _resolve(done, error)

    def shutdown(self) -> None:
        """Stop the child (requests in flight get a RuntimeError) and wait for it to exit."""
        if self._stopped:
            return
        self._stopped = True
        self._outbox.put(("shutdown", next(self._ids), "", None))
        self._outbox.put(None)
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._kill()
        self._receiver.join(timeout=10)
        self._cmd_send.close()


def exit_cause(returncode: int | None) -> str:
    """'exit code 3' or 'killed by SIGKILL' (a negative return code is the signal's number)."""
    if returncode is not None and returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def _pythonpath() -> str:
    """The child imports this very package, wherever it was imported from."""
    root = str(Path(__file__).resolve().parents[2])
    rest = os.environ.get("PYTHONPATH")
    return root + (os.pathsep + rest if rest else "")


def _picklable(e: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def child_main(cmd_fd: int, out_fd: int) -> None:
    """The child's entry point: the first message on the command pipe is (EngineConfig, parent pid,
    torch threads or None)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent decides
    cmd_conn, out_conn = Connection(cmd_fd, writable=False), Connection(out_fd, readable=False)
    try:
        config, parent_pid, threads = cmd_conn.recv()
    except EOFError:
        return
    if threads:
        import torch

        torch.set_num_threads(threads)
    _core_main(config, cmd_conn, out_conn, parent_pid)


def _core_main(config: EngineConfig, cmd_conn, out_conn, parent_pid: int) -> None:
    """Load, then apply commands and step until told to stop or the parent is gone."""
    from .llm_engine import LLMEngine

    try:
        engine = LLMEngine(config)
    except BaseException as e:
        out_conn.send(("error", _picklable(e)))
        return
    out_conn.send(("ready", {"max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size,
                             "model_path": engine.model_path, "stats": engine.stats()}))
    while True:
        if not engine.has_unfinished_requests():
            while not cmd_conn.poll(1.0):  # idle: sleep on the pipe, and notice an orphaned child
                if os.getppid() != parent_pid:
                    return
        replies = []
        try:
            while cmd_conn.poll():
                kind, cid, rid, payload = cmd_conn.recv()
                if kind == "shutdown":
                    for r in list(engine.requests):
                        engine.abort_request(r)
                    out_conn.send(("closed",))
                    return
                if kind == "add":
                    try:
                        engine.add_request(rid, *payload)
                        replies.append(("added", cid, rid, None))
                    except Exception as e:  # a bad request: its caller raises it
                        replies.append(("added", cid, rid, _picklable(e)))
                else:
                    replies.append(("aborted", cid, rid, engine.abort_request(rid)))
        except EOFError:  # the parent closed the pipe
            return
        outputs = []
        if engine.has_unfinished_requests():
            try:
                outputs = engine.step()
            except WorkerDiedError:  # tensor parallelism lost a rank: no later step can run; exiting lets
                traceback.print_exc()  # the parent fail the requests in flight and restart the engine
                engine.shutdown()
                sys.exit(1)
            except Exception:  # never wedge: fail the requests in flight, free their blocks
                traceback.print_exc()  # the server's stderr; the clients get no internals
                ids = list(engine.requests)
                for r in ids:
                    engine.abort_request(r)
                replies.append(("failed", -1, ids, EngineStepError()))
        if replies or outputs:
            try:
                out_conn.send(("batch", replies, outputs, engine.stats()))
            except OSError:  # the parent is gone
                return
