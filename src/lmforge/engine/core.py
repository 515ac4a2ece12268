"""`EngineCore`: an `LLMEngine` driven by typed commands (vLLM's `vllm/v1/engine/core.py`), and the
engine core process's entry point.

The core applies `EngineCoreRequest`s (add, abort) and steps; it answers with `EngineCoreOutputs`
(the replies in command order, a step's outputs or its failure, a stats snapshot after both). If a
step raises, every request in flight is aborted (freeing its blocks) and gets an `EngineStepError`;
the traceback goes to the log, not to the clients, and the core keeps serving new requests. Both
engine clients (`core_client.py`) run this same core: in a thread of the caller's process, or here,
in a child process that reads commands from one pipe and writes outputs to another:

    child_main: CoreStart -> load -> Status(READY, EngineInfo) -> loop: apply commands, step, send

The child exits when told to (SHUTDOWN: requests aborted, then Status(CLOSED)), when its parent
goes away, or, with tensor parallelism, with exit code 1 when a worker rank died (no later step can
run: the parent fails the requests in flight and may restart the engine). It knows nothing about
asyncio or HTTP.
"""

from __future__ import annotations

import logging
import os
import sys
from multiprocessing.connection import Connection

import torch

from lmforge.tools.procs import Status, StatusKind, ignore_sigint, startup_done
from lmforge.tools.redact import redacted_traceback

from .executor import WorkerDiedError
from .llm_engine import LLMEngine
from .messages import (CoreStart, EngineCoreOutputs, EngineCoreRequest, EngineInfo, EngineStepError, Reply,
                       RequestType, StepFailure, picklable)

log = logging.getLogger("lmforge.engine")


class EngineCore:
    """Commands in, `EngineCoreOutputs` out, over one `LLMEngine` it alone touches. `portable`: errors
    in replies must survive a pipe (the child process's core)."""

    def __init__(self, engine: LLMEngine, portable: bool = False):
        self.engine, self.portable = engine, portable

    def info(self) -> EngineInfo:
        e = self.engine
        return EngineInfo(e.max_model_len, e.vocab_size, e.model_path, e.stats())

    def apply(self, request: EngineCoreRequest) -> Reply:
        """Add or abort one request. A refused add (ValueError naming the numbers) is its reply's error."""
        rid = request.request_id
        if request.type is RequestType.ABORT:
            return Reply(RequestType.ABORT, request.cid, rid, output=self.engine.abort_request(rid))
        try:
            self.engine.add_request(rid, request.prompt, request.params, request.arrival_time, request.lora_request)
        except Exception as e:  # a bad request: its caller raises it
            return Reply(RequestType.ADD, request.cid, rid, error=picklable(e) if self.portable else e)
        return Reply(RequestType.ADD, request.cid, rid)

    def step(self, fatal: tuple[type[BaseException], ...] = ()) -> EngineCoreOutputs:
        """One engine step. An exception of a `fatal` type propagates; any other fails the requests in
        flight (never wedge: their blocks are freed)."""
        try:
            outputs = self.engine.step()
        except fatal:
            raise
        except Exception as e:  # the messages may quote a request: logged as a length and a hash
            log.error("engine step failed; aborting the %d requests in flight:\n%s", len(self.engine.requests),
                      redacted_traceback(e))
            ids = list(self.engine.requests)
            self.abort_all()
            return EngineCoreOutputs(failure=StepFailure(ids, EngineStepError()), stats=self.engine.stats())
        return EngineCoreOutputs(outputs=outputs, stats=self.engine.stats())

    def abort_all(self) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)


# ---- the engine core process ------------------------------------------------------------------------


def child_main(cmd_fd: int, out_fd: int) -> None:
    """The child's entry point (started by `core_client.MPClient`): the first message on the command
    pipe is a `CoreStart`."""
    ignore_sigint()
    cmd_conn, out_conn = Connection(cmd_fd, writable=False), Connection(out_fd, readable=False)
    try:
        start: CoreStart = cmd_conn.recv()
    except EOFError:
        return
    if not isinstance(start, CoreStart):  # a parent bug; say so rather than fail on an attribute
        out_conn.send(Status(StatusKind.ERROR, RuntimeError(
            f"the engine process's first message was a {type(start).__name__}, not a CoreStart")))
        return
    if start.threads:  # the child computes with the threads its parent was given
        torch.set_num_threads(start.threads)
    try:
        core = EngineCore(LLMEngine(start.config), portable=True)
    except BaseException as e:
        out_conn.send(Status(StatusKind.ERROR, picklable(e)))
        return
    out_conn.send(Status(StatusKind.READY, core.info()))
    startup_done()
    _serve(core, cmd_conn, out_conn, start.parent_pid)


def _serve(core: EngineCore, cmd_conn: Connection, out_conn: Connection, parent_pid: int) -> None:
    """Apply commands and step until told to stop or the parent is gone."""
    engine = core.engine
    while True:
        if not engine.has_unfinished_requests() and not _wait_for_commands(cmd_conn, parent_pid):
            return
        try:
            requests = _drain(cmd_conn)
        except EOFError:  # the parent closed the pipe
            return
        if any(r.type is RequestType.SHUTDOWN for r in requests):
            core.abort_all()
            out_conn.send(Status(StatusKind.CLOSED))
            return
        replies = [core.apply(r) for r in requests]
        # a step's outputs carry the stats taken after it (and after these replies): not taken twice
        batch = _step(core) if engine.has_unfinished_requests() else EngineCoreOutputs()
        batch.replies = replies
        if batch.replies or batch.outputs or batch.failure:
            batch.stats = batch.stats or engine.stats()
            try:
                out_conn.send(batch)
            except OSError:  # the parent is gone
                return


def _wait_for_commands(cmd_conn: Connection, parent_pid: int) -> bool:
    """Idle: sleep on the pipe, and notice an orphaned child (False: the parent is gone)."""
    while not cmd_conn.poll(1.0):
        if os.getppid() != parent_pid:
            return False
    return True


def _drain(cmd_conn: Connection) -> list[EngineCoreRequest]:
    """Every command waiting on the pipe, up to a SHUTDOWN (what follows it is never applied)."""
    requests = []
    while cmd_conn.poll():
        requests.append(cmd_conn.recv())
        if requests[-1].type is RequestType.SHUTDOWN:
            break
    return requests


def _step(core: EngineCore) -> EngineCoreOutputs:
    try:
        return core.step(fatal=(WorkerDiedError,))
    except WorkerDiedError as e:  # tensor parallelism lost a rank: no later step can run; exiting lets the
        log.error("a tensor-parallel worker died:\n%s", redacted_traceback(e))  # parent fail the requests and restart
        core.engine.shutdown()
        sys.exit(1)
