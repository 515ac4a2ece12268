"""Local multi-process runs for the benchmarks: `run_local(fn, world, *args)` starts `world`
processes with `multiprocessing` (spawn), joins them in one gloo group, calls
`fn(rank, world, *args)` in each and returns the values they returned, in rank order.

Under torchrun nothing here is needed (`lmforge.parallel.distributed.init_distributed` joins the group torchrun
describes; the tests run `lmforge.parallel.selftest` that way). This launches a benchmark's
processes from one command, not training (training always goes through torchrun). It knows nothing
about models.

    from lmforge.parallel.launch import run_local
    results = run_local(my_module.worker, 4, config)    # worker must be importable (spawn pickles it)
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world: int, port: int, threads: int, out: str, args: tuple,
           backend: str = "gloo") -> None:
    # deferred: a fresh spawned process; this module is imported by CLIs that must not load torch
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
    finally:
        if dist.is_initialized():  # fn may have ended the group itself (the trainer does)
            dist.destroy_process_group()
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def run_local(fn: Callable, world: int, *args: Any, threads: int = 1, timeout: float = 600,
              backend: str = "gloo") -> list[Any]:
    """Run `fn(rank, world, *args)` in `world` fresh processes (`backend`, `threads` torch threads each)."""
    import multiprocessing as mp  # deferred: as torch above, only when processes start

    ctx = mp.get_context("spawn")  # fork after torch has started its thread pools can hang
    with tempfile.TemporaryDirectory(prefix="lmforge-launch-") as out:
        # OMP_NUM_THREADS is read when the child imports torch: set it before the children start
        old = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(threads)
        try:
            port = free_port()
            procs = [ctx.Process(target=_entry, args=(r, fn, world, port, threads, out, args, backend))
                     for r in range(world)]
            for p in procs:
                p.start()
        finally:
            if old is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = old
        for p in procs:
            p.join(timeout)
        failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
        for p in procs:
            if p.is_alive():
                p.kill()
        if failed:
            raise RuntimeError(f"run_local({getattr(fn, '__name__', fn)}): ranks {failed} (rank, exit code) failed; "
                               f"their traceback is on stderr above")
        return [pickle.loads(Path(out, f"rank{r}.pkl").read_bytes()) for r in range(world)]
