"""The typed messages that cross the engine's process boundaries (vLLM's `EngineCoreRequestType` and
its msgspec structs; here dataclasses and Enums, pickled over `multiprocessing` pipes).

Three conversations use them:

    front <-> engine core (core_client.py, core.py)
        CoreStart, then EngineCoreRequest(ADD | ABORT | SHUTDOWN) ...
        <- Status(READY, EngineInfo) | Status(ERROR, exception), then EngineCoreOutputs ..., Status(CLOSED)
    rank 0 <-> a tensor-parallel worker (executor.py, worker.py)
        WorkerStart, KVPoolSize, then one `model_runner.StepInputs` per step ... and Stop
        <- Status(JOINING), Status(READY) | Status(ERROR, text)
    server <-> its exchange-log writer (serve/exchange_log.py)
        list of rows ... <- Status(READY), then Status(OK, rows) | Status(ERROR, text) per batch

`Status` (a child's state change or acknowledgement) lives in `lmforge.tools.procs`, which the
exchange-log writer imports without torch. The in-process engine client speaks the same requests
and outputs, minus the pipe. This module knows
nothing about how messages travel or what handles them.
"""

from __future__ import annotations

import enum
import pickle
from dataclasses import dataclass, field

from .config import EngineConfig
from .lora import LoRARequest
from .outputs import RequestOutput
from .sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine is gone (shut down, or its process exited): the message names the cause."""


class EngineStepError(RuntimeError):
    """A step raised. Requests are validated at admission, so this is a bug, not the client's fault:
    every request in that step is aborted with this error, which says nothing about its internals
    (the traceback goes to the log)."""

    def __init__(self, message: str = "internal error: the engine step failed and this request was aborted; "
                                      "the server log has the details"):
        super().__init__(message)


# ---- front <-> engine core ------------------------------------------------------------------------


class RequestType(enum.Enum):
    ADD = "add"
    ABORT = "abort"
    SHUTDOWN = "shutdown"


@dataclass(frozen=True)
class CoreStart:
    """The engine core process's first message: what to load, whom to outlive, how many threads."""
    config: EngineConfig
    parent_pid: int
    threads: int | None


@dataclass(frozen=True)
class EngineCoreRequest:
    """One command to the engine core; `cid` pairs it with its `Reply`. ADD carries the prompt,
    its parameters, its arrival time (on the caller's clock, so TTFT counts the wait for a step) and the
    LoRA adapter it runs with, if any."""
    type: RequestType
    cid: int
    request_id: str = ""
    prompt: str | list[int] | None = None
    params: SamplingParams | None = None
    arrival_time: float | None = None
    lora_request: LoRARequest | None = None


@dataclass(frozen=True)
class Reply:
    """The answer to an ADD (`error`: the refusal, or None) or an ABORT (`output`: the request's last
    output, or None if it was unknown)."""
    type: RequestType
    cid: int
    request_id: str
    error: BaseException | None = None
    output: RequestOutput | None = None


@dataclass(frozen=True)
class StepFailure:
    """A step raised: these requests were aborted and each gets `error`."""
    request_ids: list[str]
    error: BaseException


@dataclass
class EngineCoreOutputs:
    """What the core hands the front after applying commands and stepping: the replies in command
    order, then one step's outputs (or its failure), and a stats snapshot taken after both."""
    replies: list[Reply] = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)
    failure: StepFailure | None = None
    stats: dict = field(default_factory=dict)


@dataclass(frozen=True)
class EngineInfo:
    """What the front reads of a loaded engine and never changes."""
    max_model_len: int
    vocab_size: int
    model_path: str
    stats: dict


# ---- rank 0 <-> tensor-parallel workers ------------------------------------------------------------


@dataclass(frozen=True)
class WorkerStart:
    """A worker's first message: its config (with its own device), rank, rank 0's store port, threads."""
    config: EngineConfig
    rank: int
    store_port: int
    threads: int


@dataclass(frozen=True)
class KVPoolSize:
    """The KV pool size rank 0 chose (so all pools match): the worker builds its runner."""
    num_blocks: int


@dataclass(frozen=True)
class Stop:
    """Exit now."""


def picklable(e: BaseException) -> BaseException:
    """`e` itself if it survives a pipe, else a RuntimeError carrying its type and message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")
