"""Parity self-test of every strategy on the processes torchrun started: run it on a new cluster (or
in the test suite) before a long job, with the same torchrun line as training.

    torchrun --nnodes 1 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29500 \\
        --rdzv-id selftest -m lmforge.parallel.selftest --out runs/selftest

Each rank writes `OUT/rank{r}.pkl` with what it computed (`load(out, world)` reads them back) for
a caller to hold against one process, as `tests/test_parallel_lab.py` does: pipeline parallelism (GPipe, 1F1B; all ranks are stages) and tensor
parallelism (TP = world size) on a tiny random model in float64 and float32 (losses, logits,
gradients, all-reduce bytes per layer), one pipeline bench cell per schedule, the comm benchmark's
rows, and the trainer on random packed data: FSDP and PP, each also interrupted after its first
checkpoint and resumed, and last TP through `lmforge.train`'s own entry point. Nothing is
downloaded. It knows nothing about pytest.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Annotated

import torch
import torch.distributed as dist
import typer

from lmforge.config import load_config
from lmforge.train.commands import main
from lmforge.train.config import TrainConfig
from lmforge.train.loop import Trainer

from .distributed import init_distributed
from .parity import Spec, pp_worker, tp_worker
from .probes import QUICK_SIZES, BenchSpec, bench_worker, comm_worker, random_packed

STEPS = 3
# the trainer runs: configs/tiny.yaml's model (TP=2 and PP=2 split it), float32, a checkpoint at step 2
TRAIN = ["model.hidden_size=64", "model.intermediate_size=176", "model.num_hidden_layers=2",
         "model.num_attention_heads=4", "model.num_key_value_heads=2", "train.dtype=float32", "train.lr=3e-3",
         f"train.max_steps={STEPS}", "train.ckpt_every=2", "train.eval_every=2", "train.eval_batches=1",
         "train.log_every=0", "train.warmup_steps=1", "train.seed=0"]


def train_overrides(packed: Path, *extra: str) -> list[str]:
    return [f"data.path={packed}", *TRAIN, *extra]


def _interrupted_copy(src: Path, dst: Path, rank: int) -> None:
    """`dst` = the finished run `src` without its last checkpoint, as if it had died after step 2."""
    if rank == 0:
        shutil.copytree(src, dst)
        shutil.rmtree(dst / "checkpoints" / f"step-{STEPS:08d}")
    dist.barrier()


def run(out: Path) -> dict:
    init_distributed("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    res = {f"pp_{d}": pp_worker(rank, world, Spec(dtype=d)) for d in ("float64", "float32")}
    res.update({f"tp_{d}": tp_worker(rank, world, Spec(dtype=d)) for d in ("float64", "float32")})
    res["bench"] = bench_worker(rank, world, BenchSpec(stages=(world,), microbatches=(1, 4), hidden_size=32,
                                                       intermediate_size=64, num_hidden_layers=world,
                                                       vocab_size=64, seq_len=16, steps=1, calib_reps=1))
    res["comm"] = comm_worker(rank, world, QUICK_SIZES, 2)
    packed = out / "packed"
    if rank == 0:
        random_packed(packed)
    dist.barrier()
    # the Trainer directly: loop.train() would end the process group after the first run
    for name, extra in (("fsdp", ["train.batch_size=1", "train.parallel.fsdp=true"]),
                        ("pp", ["train.batch_size=2", f"train.parallel.pp={world}", "train.parallel.microbatches=2"])):
        cfg = lambda: load_config(TrainConfig, None, train_overrides(packed, *extra))  # noqa: E731 (fresh each run)
        Trainer(cfg(), out / name).fit()
        _interrupted_copy(out / name, out / f"{name}-resumed", rank)
        Trainer(cfg(), out / f"{name}-resumed", resume=True).fit()
    # last: exactly what `torchrun ... -m lmforge.train ... train.parallel.tp=N` runs (it ends the group)
    main(None, train_overrides(packed, "train.batch_size=2", f"train.parallel.tp={world}"), str(out / "tp"))
    (out / f"rank{rank}.pkl").write_bytes(pickle.dumps(res))
    return res


def load(out: Path, world: int) -> list[dict]:
    return [pickle.loads((Path(out) / f"rank{r}.pkl").read_bytes()) for r in range(world)]


def cli(out: Annotated[Path, typer.Option(help="Folder for the per-rank results and the training runs.")] = Path(
        "runs/selftest")) -> None:
    torch.set_num_threads(1)
    run(out)


if __name__ == "__main__":
    typer.run(cli)
