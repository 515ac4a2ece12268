"""A tensor-parallel worker (ranks 1..N-1): load a shard, then run every forward rank 0 sends.

Started by `executor.MultiprocExecutor` as a child interpreter; rank 0 speaks to it over one pipe in
typed messages (`messages.py`): `WorkerStart` (config, rank, store port, threads), then `KVPoolSize`
(the pool size rank 0 chose), then one `model_runner.StepInputs` per step, until `Stop` or EOF
(rank 0 is gone). The worker answers `Status(JOINING)` before it joins the process group, then
`Status(READY)`, or `Status(ERROR, text)` if loading failed. It never samples (only rank 0 applies
the LM head). A failed forward (a peer left mid-step, or a bug) exits the process, which breaks rank
0's all-reduce, which names this rank. This module knows nothing about scheduling or sampling.
"""

from __future__ import annotations

import contextlib
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from lmforge.quant import load_pretrained
from lmforge.tools.procs import Status, StatusKind, exit_now, ignore_sigint

from .config import EngineConfig
from .executor import LOAD_TIMEOUT_S, CommCounter, new_group, shard_model  # executor owns the TP layer
from .messages import KVPoolSize, Stop, WorkerStart
from .model_runner import ModelRunner


def worker_main(fd: int) -> None:
    """A worker's entry point; `fd` is its end of the pipe to rank 0."""
    ignore_sigint()
    conn = Connection(fd)
    try:
        start: WorkerStart = conn.recv()
    except EOFError:
        return
    torch.set_num_threads(start.threads)
    try:
        runner = _load(conn, start.config, start.rank, start.store_port)
    except Exception as e:
        traceback.print_exc()
        with contextlib.suppress(OSError):
            conn.send(Status(StatusKind.ERROR, f"{type(e).__name__}: {e}"))
        exit_now(1)
    if runner is None:  # rank 0 stopped before the KV pool was sized
        exit_now(0)
    _serve(conn, runner)


def _serve(conn: Connection, runner: ModelRunner) -> None:
    while True:
        try:
            inputs = conn.recv()
        except EOFError:  # rank 0 is gone
            exit_now(0)
        if isinstance(inputs, Stop):
            exit_now(0)
        try:
            runner.execute(inputs, logits=False)
        except Exception:  # a peer left mid-step or a bug: exiting breaks rank 0's all-reduce, which says so
            traceback.print_exc()
            exit_now(1)


def _load(conn: Connection, config: EngineConfig, rank: int, port: int) -> ModelRunner | None:
    """Join the group, load and shard the model, then build the runner once rank 0 sized the KV pool
    (None: rank 0 stopped first)."""
    device = torch.device(config.device)
    conn.send(Status(StatusKind.JOINING))
    store = dist.TCPStore("127.0.0.1", port, config.tensor_parallel_size, is_master=False,
                          timeout=timedelta(seconds=LOAD_TIMEOUT_S))
    group = new_group(store, rank, config.tensor_parallel_size, device)
    torch.manual_seed(config.seed)
    model = load_pretrained(Path(config.model), dtype=config.dtype, device=device)
    shard_model(model, rank, config.tensor_parallel_size, group, CommCounter())
    pool = conn.recv()
    if not isinstance(pool, KVPoolSize):  # Stop
        return None
    runner = ModelRunner(model, pool.num_blocks, config.block_size, config.attention == "reference",
                         config.pack_weights, config.cpu_kernels, config.kv_cache_dtype, config.quant_activations)
    conn.send(Status(StatusKind.READY))
    return runner
