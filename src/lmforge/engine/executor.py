"""`MultiprocExecutor`: tensor parallelism for the engine, one process per rank (vLLM's multiprocessing
executor).

Rank 0 is the engine's own process: it schedules, runs its shard of each forward and samples. Ranks
1..N-1 are worker processes that hold their shard and their own paged KV pool and only run forwards.
Each step rank 0 pickles the step's `StepInputs` (token ids, positions, block tables: plain ints, a
few KB) down one pipe per worker; every rank builds the same attention metadata from them and runs the
same layers, and the row-parallel projections all-reduce their partial outputs over a private gloo
(CPU) or NCCL (CUDA) process group. Only rank 0 applies the LM head and samples.

Sharding is Megatron's (Shoeybi et al. 2019; `lmforge.model.tensor_parallel` does it for training):
q/k/v and gate/up keep rank r's slice of output rows (whole heads: N/tp query and K/tp kv heads, so
each rank caches only its kv heads), o_proj and down_proj rank r's slice of input columns, followed by
an all-reduce; embeddings, norms and the LM head stay replicated. Inference needs no autograd, so the
column shards are plain `nn.Linear`s (the CPU weight packing and the fused C kernels apply to them as
to an unsharded model) and `RowParallelLinear` all-reduces in its forward. A layer all-reduces two
activations of T x D elements: 2 * D * dtype bytes per layer per token, whatever N (`CommCounter`).

Workers are plain child interpreters (`lmforge.tools.procs`; their side is `worker.py`), and rank 0
speaks to each over one pipe in typed messages (`messages.py`: `WorkerStart`, `KVPoolSize`, one
`StepInputs` per step, `Stop`; a worker answers `Status(JOINING)`, then `Status(READY)` or
`Status(ERROR)`). A worker exits when rank 0 tells it, when rank 0's end of its pipe closes (rank 0 died) or when a
collective fails. Rank 0 stops its workers on `shutdown()`, when the executor is garbage-collected,
and at interpreter exit (`weakref.finalize`); a worker that dies surfaces as `WorkerDiedError`,
naming the rank and its exit cause. The process group is the executor's own, not
torch.distributed's default group: a training job's group is untouched and several engines can live
in one process. This module knows nothing about scheduling or sampling.

    llm = LLM("path/to/hf-dir", tensor_parallel_size=2)     # or: lmforge serve DIR --tensor-parallel-size 2
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import time
import weakref
from datetime import timedelta
from multiprocessing.connection import Connection, Pipe

import torch
import torch.distributed as dist
from torch import nn

from lmforge.model.tensor_parallel import COLUMN, ROW, CommCounter, GroupAllReduce, RowParallelLinear, plain_linear

from lmforge.model.checkpoint import read_hf_config
from lmforge.model.config import ModelConfig
from lmforge.tools.procs import Status, StatusKind, exit_cause, start_python, stop

from .config import EngineConfig
from .messages import KVPoolSize, Stop, WorkerStart
from .model_runner import StepInputs

LOAD_TIMEOUT_S = 600.0  # a worker's import + load, as the engine core's
COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # a step's all-reduce waits this long for a rank that hangs


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process is gone; the engine cannot step any more."""


# ---- sharding ---------------------------------------------------------------------------------------

def check_tensor_parallel(config: EngineConfig) -> None:
    """Refuse, before any process starts, a model or option that tensor parallelism here does not take."""
    size = config.tensor_parallel_size
    hf = read_hf_config(config.model)
    if hf.get("quantization_config"):
        raise ValueError(f"tensor_parallel_size={size}: quantized checkpoints ({config.model}/config.json has "
                         "quantization_config) are not supported with tensor parallelism; use tensor_parallel_size=1")
    mc = ModelConfig.from_hf(hf)
    for name, n in (("num_attention_heads", mc.num_attention_heads), ("num_key_value_heads", mc.num_key_value_heads),
                    ("intermediate_size", mc.intermediate_size)):
        if n % size:
            raise ValueError(f"tensor_parallel_size={size} must divide the model's {name}={n} "
                             f"({config.model}/config.json); pick a size that divides heads, kv heads and MLP width")
    if config.device not in ("auto", "cpu", "cuda", "cuda:0"):
        raise ValueError(f"tensor_parallel_size={size} with device={config.device!r}: rank r runs on cuda:r "
                         "(or the CPU); pass device='auto', 'cuda' or 'cpu'")
    if _device(config).type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"tensor_parallel_size={size} needs {size} CUDA devices, {torch.cuda.device_count()} visible")


def _device(config: EngineConfig, rank: int = 0) -> torch.device:
    cuda = config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available())
    return torch.device("cuda", rank) if cuda else torch.device("cpu")


def shard_model(model: nn.Module, rank: int, size: int, group, counter: CommCounter) -> None:
    """Keep rank r's Megatron shard of every decoder layer of a loaded `Transformer`, in place."""
    for i, layer in enumerate(model.model.layers):
        for block, kind, names in ((layer.self_attn, "attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                                   (layer.mlp, "mlp", ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                lin = getattr(block, name)
                if type(lin) is not nn.Linear:
                    raise ValueError(f"tensor parallelism shards nn.Linear layers; layer {i} {name} is "
                                     f"{type(lin).__name__}")
                if name in ROW:
                    setattr(block, name, RowParallelLinear(lin, rank, size, GroupAllReduce(group, counter, i, kind)))
                else:
                    assert name in COLUMN
                    rows = lin.out_features // size
                    part = slice(rank * rows, (rank + 1) * rows)
                    setattr(block, name, plain_linear(lin.weight.detach()[part],
                                                      None if lin.bias is None else lin.bias.detach()[part]))
        attn = layer.self_attn
        attn.n_heads, attn.n_kv_heads = attn.n_heads // size, attn.n_kv_heads // size
    model.tensor_parallel = (rank, size)


def new_group(store: dist.Store, rank: int, size: int, device: torch.device):
    """This executor's own process group (not torch.distributed's default one): gloo on CPU, NCCL on CUDA."""
    store = dist.PrefixStore("lmforge-tp", store)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        return dist.ProcessGroupNCCL(store, rank, size)
    # one host: gloo's pairs on loopback, whatever the machine's hostname resolves to
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = COLLECTIVE_TIMEOUT
    return dist.ProcessGroupGloo(store, rank, size, opts)


def threads_per_rank(size: int) -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus // size)


# ---- rank 0 -----------------------------------------------------------------------------------------

class MultiprocExecutor:
    """Rank 0's side: starts ranks 1..N-1, shards rank 0's model, sends each step's inputs."""

    def __init__(self, config: EngineConfig):
        check_tensor_parallel(config)
        self.size = config.tensor_parallel_size
        self.device = _device(config)
        self.counter = CommCounter()  # rank 0's all-reduces; every rank runs the same ones
        self.group = None
        self.error: str | None = None  # set once a step failed: no later step can run
        self.threads = threads_per_rank(self.size)
        torch.set_num_threads(self.threads)
        # the rendezvous: rank 0 serves the store on a free port; the group itself is made in `shard`
        self._store = dist.TCPStore("127.0.0.1", 0, self.size, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=LOAD_TIMEOUT_S))
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self._loaded = [False]  # every worker said "ready": they answer a stop message at once
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.conns, self._loaded)
        for rank in range(1, self.size):
            ours, theirs = Pipe(duplex=True)
            self.procs.append(start_python(f"from lmforge.engine.worker import worker_main; "
                                           f"worker_main({theirs.fileno()})", (theirs.fileno(),)))
            theirs.close()
            self.conns.append(ours)
            ours.send(WorkerStart(dataclasses.replace(config, device=str(_device(config, rank))), rank,
                                  self._store.port, self.threads))
        self.pids = [p.pid for p in self.procs]

    def shard(self, model: nn.Module) -> None:
        """Join the group once every worker is ready to, then keep rank 0's shard of `model`."""
        self._wait(StatusKind.JOINING)
        self.group = new_group(self._store, 0, self.size, self.device)
        shard_model(model, 0, self.size, self.group, self.counter)

    def start(self, num_blocks: int) -> None:
        """Tell every worker its KV pool size (rank 0 decides, so all pools match) and wait until they are ready."""
        for conn in self.conns:
            conn.send(KVPoolSize(num_blocks))
        self._wait(StatusKind.READY)
        self._loaded[0] = True

    def _wait(self, what: StatusKind) -> None:
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while not conn.poll(0.2):
                if proc.poll() is not None or time.monotonic() > deadline:
                    self.shutdown()
                    raise WorkerDiedError(f"tensor-parallel worker {rank} {self._cause(proc)} while loading")
            try:
                msg = conn.recv()
            except EOFError:
                msg = Status(StatusKind.ERROR, "closed its pipe")
            if msg.kind is not what:
                self.shutdown()
                raise WorkerDiedError(f"tensor-parallel worker {rank} failed while loading: {msg.detail}")

    def send(self, inputs: StepInputs) -> None:
        """Hand one step's inputs to every worker (they start their forward at once)."""
        if self.error is not None:
            raise WorkerDiedError(self.error)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send(inputs)
            except OSError as e:  # the workers sent to already are in a forward that cannot finish
                raise self._fail(self._died(rank)) from e

    @contextlib.contextmanager
    def guard(self):
        """Around rank 0's forward. The workers run the same forward: once rank 0's fails, their
        all-reduces can never be matched again, so they are stopped and the executor refuses later
        steps. A failed all-reduce whose peer is gone names that rank."""
        try:
            yield
        except BaseException as e:
            dead = self._first_dead(2.0 if isinstance(e, RuntimeError) else 0.0)  # an exit may lag the reset
            error = self._fail(self._died(dead) if dead else WorkerDiedError(
                f"rank 0's forward failed ({type(e).__name__}: {e}); the tensor-parallel workers were stopped "
                "(their collectives cannot be matched again): restart the engine"))
            if not isinstance(e, Exception):  # KeyboardInterrupt and the like stay what they are
                raise
            raise error from e

    def _fail(self, error: WorkerDiedError) -> WorkerDiedError:
        """Record why no step can run any more and stop the workers (killed: they may be waiting in a
        collective that will never complete, deaf to a stop message)."""
        self.error = str(error)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        self.shutdown()
        return error

    def _first_dead(self, wait_s: float) -> int | None:
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None:
                    return rank
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _died(self, rank: int) -> WorkerDiedError:
        proc = self.procs[rank - 1]
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
        return WorkerDiedError(f"tensor-parallel worker {rank} (pid {proc.pid}) {self._cause(proc)}; "
                               "the engine cannot continue: restart it")

    @staticmethod
    def _cause(proc: subprocess.Popen) -> str:
        if proc.poll() is None:
            return "did not answer in time"
        return f"exited ({exit_cause(proc.returncode)})"

    def shutdown(self) -> None:
        """Stop every worker (idempotent); also runs when the executor is collected and at exit."""
        self._finalizer()


def _stop_workers(procs: list[subprocess.Popen], conns: list[Connection], loaded: list[bool]) -> None:
    """Ask each worker to exit (a loaded one reads its pipe between steps), then kill what is left; a
    worker still loading may be blocked joining the group, so it is killed at once."""
    for conn in conns:
        with contextlib.suppress(OSError, ValueError):
            conn.send(Stop())
        conn.close()
    for proc in procs:
        stop(proc, grace_s=10 if loaded[0] else 0.5)
