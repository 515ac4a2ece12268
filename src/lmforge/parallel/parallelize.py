"""Parallelism as a plan applied to a model, not a trainer subclass (torchtitan's `parallelize_llama`).

`plan_for(cfg)` returns the `DataParallel` plan (one process, or DDP under torchrun) or, when
`train.parallel.tp > 1`, `pp > 1` or `fsdp=true`, the `ShardedParallel` plan. The one trainer
(`lmforge.train.loop.Trainer`) asks its plan to join the process group (`setup`), to shard the model
(`parallelize`), to wrap it for data parallelism, to clip gradients, and for the
checkpoint pieces that only it knows (sharded model and optimizer files, the layout it was written with).

Ranks form a grid: tensor-parallel groups of `tp` consecutive ranks (one node: TP all-reduces
twice per layer and must stay on the fastest link), data-parallel groups of the ranks with the same
TP index. Data is sharded over the data-parallel ranks only (a TP group reads one batch); the loss,
token counts and evaluation sums are reduced over the data-parallel group. With `fsdp`, parameters,
gradients and AdamW state are sharded over the data-parallel ranks by `fully_shard` (each decoder
layer, then the root), and checkpoints are sharded through `torch.distributed.checkpoint`; under
TP or PP, each rank writes its own shard file. With `pp`, each process is one stage
(`pipeline.py`), every stage reads the same batch, each batch is cut into `microbatches` that the
`schedule` (GPipe or 1F1B) runs (`pipeline_step`, `pipeline_evaluate`), and each step logs its
measured bubble. Either way `state.pt` also holds the unsharded model, so `lmforge export` reads
these runs as any other, and `meta.json`, written last, carries the hashes of every file. It knows
nothing about the model's internals (`lmforge.model.tensor_parallel` does) or data loading.

    torchrun --nproc-per-node 2 -m lmforge.train configs/tiny.yaml data.path=runs/packed train.parallel.tp=2
    torchrun --nproc-per-node 2 -m lmforge.train configs/tiny.yaml data.path=runs/packed train.parallel.fsdp=true
    torchrun --nproc-per-node 2 -m lmforge.train configs/tiny.yaml data.path=runs/packed train.parallel.pp=2 \
        train.parallel.microbatches=4
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lmforge.config import ConfigError, to_dict
from lmforge.model.tensor_parallel import apply_tensor_parallel, full_state_dict, grad_norm
from lmforge.train import checkpoint as ckpt
from lmforge.train.guards import TrainingDiverged, mem_bytes
from lmforge.track.io import sha256_dir, sha256_file

from .distributed import Dist, GroupDist, init_distributed
from .parity import split_microbatches
from .pipeline import IGNORE, PipelineExecutor, PipelineStageModule, tied_group
from .schedules import schedule

DCP_DIR = "dcp"


@dataclass
class Groups:
    """The process groups a sharded run uses (None where that kind of parallelism is off)."""
    tp: Any = None
    dp: Any = None
    pp_ranks: list[int] | None = None


class DataParallel:
    """One process, or DDP over every process torchrun started: the model is replicated."""

    note: str | None = None
    pipelined = False
    stage = executor = None

    def setup(self, device_name: str) -> tuple[Dist, torch.device]:
        self.d, self.device = init_distributed(device_name)
        return self.d, self.device

    def parallelize(self, model: torch.nn.Module, raw_model: torch.nn.Module, cfg: Any) -> torch.nn.Module:
        return model

    def wrap_data_parallel(self, fwd: torch.nn.Module) -> torch.nn.Module:
        if self.d.world_size == 1:
            return fwd
        ids = [self.device.index] if self.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(fwd, device_ids=ids)

    def clip_gradients(self, model: torch.nn.Module, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def checkpoint_parts(self, model: torch.nn.Module, raw_model: torch.nn.Module, opt: Any) -> dict[str, Any]:
        """What this plan adds to the trainer's Checkpointer: the model and optimizer as plain components."""
        return {"components": {"model": model, "optimizer": opt}, "extra": {}, "shards": None, "validate": None}

    def update_record(self, rec: dict[str, Any], cfg: Any, seq_len: int) -> dict[str, Any]:
        return rec


class ShardedParallel(DataParallel):
    """Tensor, pipeline or fully sharded data parallelism (`train.parallel`), checked once here."""

    def __init__(self, cfg: Any):
        t, p = cfg.train, cfg.train.parallel
        if t.dtype == "float16":
            raise ConfigError("train.parallel: float16 needs a sharded GradScaler; use train.dtype=bfloat16 or float32")
        if p.tp > 1 and (p.fsdp or t.method != "full"):
            raise ConfigError("train.parallel.tp > 1 runs full fine-tuning without fsdp for now "
                              "(2-D TP x FSDP and LoRA under TP are not built); drop train.parallel.fsdp or set tp=1")
        if p.pp > 1 and (p.tp > 1 or p.fsdp or t.method != "full" or t.compile):
            raise ConfigError("train.parallel.pp > 1 runs alone for now (full fine-tuning, no tp/fsdp/compile); "
                              "set the others back to their defaults")
        if p.fsdp and t.fused_loss:  # the fused head reads lm_head.weight outside FSDP's forward (still sharded)
            t.fused_loss = False
            self.note = "train.parallel.fsdp: fused_loss turned off (the LM head is sharded outside forward)"
        self.p = p
        self.pipelined = p.pp > 1
        self.groups = Groups()

    def setup(self, device_name: str) -> tuple[Dist, torch.device]:
        world, device = init_distributed(device_name)
        if not dist.is_initialized():  # one process (FSDP over 1 rank): a group of one, no torchrun needed
            dist.init_process_group("gloo" if device.type == "cpu" else "nccl", store=dist.HashStore(),
                                    rank=0, world_size=1)
        self.device = device
        self.d = _grid(world, self.p, self.groups)
        return self.d, device

    def parallelize(self, model: torch.nn.Module, raw_model: torch.nn.Module, cfg: Any) -> torch.nn.Module:
        out = parallelize(model, raw_model, cfg, self.groups, self.device)
        if self.pipelined:
            self.stage = out
            self.executor = PipelineExecutor(out, self.groups.pp_ranks, tied_group(self.p.pp, self.groups.pp_ranks,
                                                                                   out.tied))
        return out

    def wrap_data_parallel(self, fwd: torch.nn.Module) -> torch.nn.Module:
        if self.p.fsdp or self.d.world_size == 1:
            return fwd  # FSDP reduce-scatters the gradients itself
        ids = [self.device.index] if self.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(fwd, device_ids=ids, process_group=self.groups.dp)

    def clip_gradients(self, model: torch.nn.Module, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        norm = _pp_grad_norm(self.stage) if self.pipelined else grad_norm(model, self.groups.tp)
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm

    def checkpoint_parts(self, model: torch.nn.Module, raw_model: torch.nn.Module, opt: Any) -> dict[str, Any]:
        """state.pt holds the unsharded model (for export, never read back) and the layout; each rank's
        model and optimizer shards go beside it."""
        full = ckpt.SaveOnly(lambda: self._full_state(model, raw_model))
        layout = ckpt.SaveOnly(lambda: {"parallel": to_dict(self.p), "world_size": dist.get_world_size()})
        return {"components": {"model": full}, "extra": {"layout": layout},
                "shards": ShardFiles(model, opt, self.p.fsdp), "validate": self._validate}

    def _full_state(self, model: torch.nn.Module, raw_model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The unsharded model state, Hugging Face names (collective)."""
        if self.pipelined:
            return _pp_full_state(self.stage, raw_model)
        if self.p.fsdp:
            # deferred: torch.distributed.checkpoint is heavy and only FSDP runs need it
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return full_state_dict(model, self.groups.tp)

    def _validate(self, state: dict[str, Any], path: Path) -> None:
        if state.get("world_size") != dist.get_world_size() or state.get("parallel") != to_dict(self.p):
            raise ConfigError(f"{path} was written by {state.get('world_size')} processes with train.parallel="
                              f"{state.get('parallel')}; resume with the same (now {dist.get_world_size()}, "
                              f"{to_dict(self.p)})")

    def update_record(self, rec: dict[str, Any], cfg: Any, seq_len: int) -> dict[str, Any]:
        rec.update(world_size=dist.get_world_size(), parallel={**to_dict(self.p), "dp": self.d.world_size},
                   effective_batch=cfg.train.batch_size * cfg.train.grad_accum * self.d.world_size)
        rec["effective_batch_tokens"] = rec["effective_batch"] * seq_len
        return rec


def plan_for(cfg: Any) -> DataParallel:
    """The parallelism plan `cfg.train.parallel` asks for."""
    return ShardedParallel(cfg) if cfg.train.parallel.active else DataParallel()


def _grid(world: Dist, p: Any, groups: Groups) -> GroupDist:
    """Every rank's place in the TP x DP grid (or its pipeline stage); fills `groups`."""
    W, r, tp = world.world_size, world.rank, p.tp
    if p.pp > 1:  # one stage per process, every stage reads the same batches
        if W != p.pp:
            raise ConfigError(f"train.parallel.pp={p.pp} runs one stage per process: launch torchrun "
                              f"--nproc-per-node {p.pp} (data parallelism over pipelines is not built), now {W}")
        groups.pp_ranks = list(range(W))
        return GroupDist(rank=0, world_size=1, local_rank=world.local_rank, global_rank=r)
    if W % tp:
        raise ConfigError(f"train.parallel.tp={tp} must divide the number of processes ({W}); "
                          f"launch torchrun --nproc-per-node {tp * max(1, W // tp)}")
    # every rank creates every group, in the same order (new_group is collective)
    tp_groups = [dist.new_group(list(range(i, i + tp))) for i in range(0, W, tp)]
    dp_groups = [dist.new_group(list(range(j, W, tp))) for j in range(tp)]
    groups.tp, groups.dp = tp_groups[r // tp], dp_groups[r % tp]
    return GroupDist(rank=r // tp, world_size=W // tp, local_rank=world.local_rank, global_rank=r, group=groups.dp)


def parallelize(model: torch.nn.Module, raw_model: torch.nn.Module, cfg: Any, groups: Groups,
                device: torch.device) -> torch.nn.Module:
    """Apply `cfg.train.parallel` to `model` (the trained module; `raw_model` the `Transformer` in it):
    this rank's pipeline stage, or tensor-parallel shards (in place), then FSDP over the data-parallel group."""
    p = cfg.train.parallel
    if p.pp > 1:
        return PipelineStageModule(raw_model, dist.get_rank(), p.pp)
    if p.tp > 1:
        apply_tensor_parallel(raw_model, groups.tp)
    if p.fsdp:
        # deferred: FSDP and device meshes load a large part of torch.distributed, only FSDP runs need them
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(groups.dp, device_type=device.type)
        for layer in raw_model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


# ---- sharded checkpoints ----------------------------------------------------------------------------


class ShardFiles:
    """Each rank's model and optimizer state beside state.pt: `dcp/` through torch.distributed.checkpoint
    under FSDP, else `rank{r}.pt` (TP shards and pipeline stages are plain tensors)."""

    def __init__(self, model: torch.nn.Module, opt: Any, fsdp: bool):
        self.model, self.opt, self.fsdp = model, opt, fsdp

    def save(self, tmp: Path) -> None:
        if self.fsdp:
            # deferred: torch.distributed.checkpoint is heavy and only FSDP runs write it
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            msd, osd = get_state_dict(self.model, self.opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp / DCP_DIR))
        else:
            torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict()},
                       tmp / f"rank{dist.get_rank()}.pt")

    def hashes(self, tmp: Path) -> dict[str, Any]:
        return {"shard_sha256": {p.name: sha256_file(p) for p in tmp.glob("rank*.pt")},
                "dcp_sha256": sha256_dir(tmp / DCP_DIR) if (tmp / DCP_DIR).is_dir() else None}

    def load(self, path: Path, meta: dict[str, Any]) -> None:
        if self.fsdp:
            # deferred: as in save
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            if sha256_dir(path / DCP_DIR) != meta.get("dcp_sha256"):
                raise ckpt.CheckpointError(f"{path / DCP_DIR} does not match the dcp_sha256 in meta.json (corrupt)")
            msd, osd = get_state_dict(self.model, self.opt)
            sharded = {"model": msd, "optim": osd}
            dcp.load(sharded, checkpoint_id=str(path / DCP_DIR))
            set_state_dict(self.model, self.opt, model_state_dict=sharded["model"], optim_state_dict=sharded["optim"])
            return
        name = f"rank{dist.get_rank()}.pt"
        if sha256_file(path / name) != meta.get("shard_sha256", {}).get(name):
            raise ckpt.CheckpointError(f"{path / name} does not match its sha256 in meta.json (corrupt)")
        shard = torch.load(path / name, map_location="cpu", weights_only=False)
        self.model.load_state_dict(shard["model"])
        self.opt.load_state_dict(shard["optimizer"])


def _pp_full_state(stage: PipelineStageModule, raw_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model state (HF names) from every stage (collective)."""
    mine = {k: v.detach().cpu() for k, v in stage.full_named_parameters()}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    full = {k: v for part in parts for k, v in part.items()}
    return {k: full[k] for k in raw_model.state_dict()}


# ---- pipeline parallelism: the step and the evaluation run through the stages ------------------------


def _pp_grad_norm(stage: PipelineStageModule) -> torch.Tensor:
    """L2 norm over every stage's gradients (a tied embedding/head counted once, on stage 0)."""
    tied = stage.tied_weight() if not stage.first else None
    sq = sum((p.grad.detach().double().pow(2).sum() for p in stage.parameters()
              if p.grad is not None and p is not tied), torch.zeros((), dtype=torch.float64))
    dist.all_reduce(sq)
    return sq.sqrt()


def pipeline_step(tr: Any) -> dict[str, float]:
    """One optimizer step of trainer `tr` through the pipeline: every micro-batch through the schedule."""
    t, p, plan_ = tr.cfg.train, tr.cfg.train.parallel, tr.par
    t0 = time.perf_counter()
    batches = [next(tr.train_iter) for _ in range(t.grad_accum)]
    n_tokens = max(sum(int((b["labels"] != IGNORE).sum()) for b in batches), 1)
    mbs = [mb for b in batches for mb in split_microbatches(b, p.microbatches)]
    actions = schedule(p.schedule, p.pp, len(mbs))[dist.get_rank()]
    with tr.autocast():
        res = plan_.executor.step(actions, mbs, 1.0 / n_tokens, torch.float32)
    loss_t = torch.tensor([res.loss_sum or 0.0], dtype=torch.float64)
    dist.broadcast(loss_t, src=plan_.groups.pp_ranks[-1])
    loss = float(loss_t)
    if not math.isfinite(loss):
        where = f"the last good checkpoint is {tr.last_ckpt}" if tr.last_ckpt else "no checkpoint was written yet"
        raise TrainingDiverged(f"loss is {loss} at step {tr.step + 1}; {where}. Lower train.lr")
    params = [q for q in tr.model.parameters() if q.requires_grad]
    norm = plan_.clip_gradients(tr.model, params, t.grad_clip if t.grad_clip > 0 else float("inf"))
    lr = tr.opt.param_groups[0]["lr"]
    tr.opt.step()
    tr.opt.zero_grad(set_to_none=True)
    tr.sched.step()
    dt = time.perf_counter() - t0
    step_tokens = sum(b["input_ids"].numel() for b in batches)
    tr.step += 1
    tr.tokens_seen += step_tokens
    tr.train_time += dt
    return {"step": tr.step, "loss": loss, "lr": lr, "grad_norm": float(norm), "tokens": tr.tokens_seen,
            "dt_s": round(dt, 6), "tokens_per_s": round(step_tokens / dt, 2), "mfu": tr.mfu(step_tokens / dt),
            "mem_bytes": mem_bytes(tr.device), "pp_bubble": round(_bubble(res.events, len(plan_.groups.pp_ranks)), 4)}


def _bubble(events: list, stages: int) -> float:
    """Measured bubble of the step: 1 - sum of the stages' compute time / (stages x step window)."""
    compute = [e for e in events if e.op in ("F", "B")]
    busy = torch.tensor([sum(e.end - e.start for e in compute)], dtype=torch.float64)
    edges = torch.tensor([-min(e.start for e in compute), max(e.end for e in compute)], dtype=torch.float64)
    dist.all_reduce(busy)
    dist.all_reduce(edges, op=dist.ReduceOp.MAX)
    return 1 - float(busy) / (stages * float(edges.sum()))


@torch.no_grad()
def pipeline_evaluate(tr: Any) -> dict[str, float] | None:
    """Val loss, perplexity and bits per byte of trainer `tr` through the pipeline (the last stage's logits)."""
    if tr.data.make_val is None:
        return None
    tr.model.eval()
    sums = torch.zeros(4, dtype=torch.float64)  # loss, tokens, loss over byte-bearing tokens, bytes
    n = tr.cfg.train.eval_batches
    whole = tr.cfg.train.stage == "pretrain" and n == 0
    tb = tr.data.token_bytes
    for batch in itertools.islice(tr.data.make_val(), None if whole else max(1, n)):
        with tr.autocast():
            logits = tr.par.executor.forward_only(batch, torch.float32)
        if logits is None:
            continue
        labels = batch["labels"].flatten()
        loss_N = F.cross_entropy(logits.float().flatten(0, 1), labels, ignore_index=IGNORE, reduction="none")
        valid = labels != IGNORE
        sums[0] += float(loss_N.sum())
        sums[1] += float(valid.sum())
        if tb is not None:
            nb = tb[labels.clamp(min=0)] * valid
            sums[2] += float((loss_N * (nb > 0)).sum())
            sums[3] += float(nb.sum())
    tr.model.train()
    dist.broadcast(sums, src=tr.par.groups.pp_ranks[-1])
    val_loss = float(sums[0] / max(float(sums[1]), 1.0))
    return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 700.0)),
            "val_bpb": float(sums[2] / (math.log(2) * sums[3])) if sums[3] else None}
