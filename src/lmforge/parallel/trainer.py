"""The trainer with tensor, pipeline and fully sharded data parallelism: `lmforge.train.loop.Trainer`
with its four parallelism hooks, its checkpointing and (pipeline only) its step and evaluation
overridden. `loop.train()` picks it when `train.parallel.tp > 1`, `pp > 1` or `fsdp=true`.

Ranks form a grid: tensor-parallel groups of `tp` consecutive ranks (one node: TP all-reduces
twice per layer and must stay on the fastest link), data-parallel groups of the ranks with the same
TP index. Data is sharded over the data-parallel ranks only (a TP group reads one batch); the loss,
token counts and evaluation sums are reduced over the data-parallel group. With `fsdp`, parameters,
gradients and AdamW state are sharded over the data-parallel ranks by `fully_shard` (each decoder
layer, then the root), and checkpoints are sharded through `torch.distributed.checkpoint`; under
TP or PP, each rank writes its own shard file. With `pp`, each process is one stage
(`pipeline.py`), every stage reads the same batch, each batch is cut into `microbatches` that the
`schedule` (GPipe or 1F1B) runs, and each step logs its measured bubble. Either way `state.pt` also holds the unsharded model, so
`lmforge export` reads these runs as any other, and `meta.json`, written last, carries the hashes
of every file. It knows nothing about the model's internals (`tensor.py` does) or data loading.

    torchrun --nproc-per-node 2 -m lmforge.train configs/tiny.yaml data.path=runs/packed train.parallel.tp=2
    torchrun --nproc-per-node 2 -m lmforge.train configs/tiny.yaml data.path=runs/packed train.parallel.fsdp=true
    torchrun --nproc-per-node 2 -m lmforge.train configs/tiny.yaml data.path=runs/packed train.parallel.pp=2 \
        train.parallel.microbatches=4
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lmforge.config import ConfigError, to_dict
from lmforge.train import checkpoint as ckpt
from lmforge.train.loop import IGNORE, Dist, Trainer, TrainingDiverged, _mem_bytes, init_distributed
from lmforge.track.io import atomic_write_json, sha256_dir, sha256_file
from lmforge.track.runs import truncate_metrics

from .parity import split_microbatches
from .pipeline import PipelineExecutor, PipelineStageModule, tied_group
from .schedules import schedule
from .tensor import apply_tensor_parallel, full_state_dict, grad_norm

DCP_DIR = "dcp"


@dataclass
class GroupDist(Dist):
    """The data-parallel view of a rank: `rank`/`world_size` index the data shards; `main` is global rank 0."""

    global_rank: int = 0

    @property
    def main(self) -> bool:
        return self.global_rank == 0


class ParallelTrainer(Trainer):
    def __init__(self, cfg, out: Path, resume: bool = False, overwrite: bool = False):
        t, p = cfg.train, cfg.train.parallel
        if t.dtype == "float16":
            raise ConfigError("train.parallel: float16 needs a sharded GradScaler; use train.dtype=bfloat16 or float32")
        if p.tp > 1 and (p.fsdp or t.method != "full"):
            raise ConfigError("train.parallel.tp > 1 runs full fine-tuning without fsdp for now "
                              "(2-D TP x FSDP and LoRA under TP are not built); drop train.parallel.fsdp or set tp=1")
        if p.pp > 1 and (p.tp > 1 or p.fsdp or t.method != "full" or t.compile):
            raise ConfigError("train.parallel.pp > 1 runs alone for now (full fine-tuning, no tp/fsdp/compile); "
                              "set the others back to their defaults")
        self.fsdp_note = None
        if p.fsdp and t.fused_loss:  # the fused head reads lm_head.weight outside FSDP's forward (still sharded)
            t.fused_loss = False
            self.fsdp_note = "train.parallel.fsdp: fused_loss turned off (the LM head is sharded outside forward)"
        self.tp = p.tp
        self.tp_counter = None
        super().__init__(cfg, out, resume=resume, overwrite=overwrite)
        if self.fsdp_note:
            self.warn(self.fsdp_note)

    # ---- the hooks ----------------------------------------------------------------------------

    def setup_distributed(self, device_name: str) -> tuple[Dist, torch.device]:
        world, device = init_distributed(device_name)
        if not dist.is_initialized():  # one process (FSDP over 1 rank): a group of one, no torchrun needed
            dist.init_process_group("gloo" if device.type == "cpu" else "nccl", store=dist.HashStore(),
                                    rank=0, world_size=1)
        W, r, tp = world.world_size, world.rank, self.tp
        pp = self.cfg.train.parallel.pp
        if pp > 1:  # one stage per process, every stage reads the same batches
            if W != pp:
                raise ConfigError(f"train.parallel.pp={pp} runs one stage per process: launch torchrun "
                                  f"--nproc-per-node {pp} (data parallelism over pipelines is not built), now {W}")
            self.tp_group = self.dp_group = None
            self.pp_ranks = list(range(W))
            return GroupDist(rank=0, world_size=1, local_rank=world.local_rank, global_rank=r), device
        if W % tp:
            raise ConfigError(f"train.parallel.tp={tp} must divide the number of processes ({W}); "
                              f"launch torchrun --nproc-per-node {tp * max(1, W // tp)}")
        # every rank creates every group, in the same order (new_group is collective)
        tp_groups = [dist.new_group(list(range(i, i + tp))) for i in range(0, W, tp)]
        dp_groups = [dist.new_group(list(range(j, W, tp))) for j in range(tp)]
        self.tp_group, self.dp_group = tp_groups[r // tp], dp_groups[r % tp]
        return GroupDist(rank=r // tp, world_size=W // tp, local_rank=world.local_rank, global_rank=r,
                         group=self.dp_group), device

    def parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        pp = self.cfg.train.parallel.pp
        if pp > 1:
            self.stage = PipelineStageModule(self.raw_model, dist.get_rank(), pp)
            self.executor = PipelineExecutor(self.stage, self.pp_ranks,
                                             tied_group(pp, self.pp_ranks, self.stage.tied))
            return self.stage
        if self.tp > 1:
            self.tp_counter = apply_tensor_parallel(self.raw_model, self.tp_group)
        if self.cfg.train.parallel.fsdp:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard

            mesh = DeviceMesh.from_group(self.dp_group, device_type=self.device.type)
            for layer in self.raw_model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        return model

    def wrap_data_parallel(self, fwd: torch.nn.Module) -> torch.nn.Module:
        if self.cfg.train.parallel.fsdp or self.d.world_size == 1:
            return fwd  # FSDP reduce-scatters the gradients itself
        ids = [self.device.index] if self.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(fwd, device_ids=ids, process_group=self.dp_group)

    def clip_gradients(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        norm = self._pp_grad_norm() if self.cfg.train.parallel.pp > 1 else grad_norm(self.model, self.tp_group)
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm

    # ---- pipeline parallelism: the step and the evaluation run through the stages --------------

    def _pp_grad_norm(self) -> torch.Tensor:
        """L2 norm over every stage's gradients (a tied embedding/head counted once, on stage 0)."""
        tied = self.stage.tied_weight() if not self.stage.first else None
        sq = sum((p.grad.detach().double().pow(2).sum() for p in self.stage.parameters()
                  if p.grad is not None and p is not tied), torch.zeros((), dtype=torch.float64))
        dist.all_reduce(sq)
        return sq.sqrt()

    def train_step(self) -> dict[str, float]:
        p = self.cfg.train.parallel
        if p.pp == 1:
            return super().train_step()
        t = self.cfg.train
        t0 = time.perf_counter()
        batches = [next(self.train_iter) for _ in range(t.grad_accum)]
        n_tokens = max(sum(int((b["labels"] != IGNORE).sum()) for b in batches), 1)
        mbs = [mb for b in batches for mb in split_microbatches(b, p.microbatches)]
        plan = schedule(p.schedule, p.pp, len(mbs))[dist.get_rank()]
        with self.autocast():
            res = self.executor.step(plan, mbs, 1.0 / n_tokens, torch.float32)
        loss_t = torch.tensor([res.loss_sum or 0.0], dtype=torch.float64)
        dist.broadcast(loss_t, src=self.pp_ranks[-1])
        loss = float(loss_t)
        if not math.isfinite(loss):
            where = f"the last good checkpoint is {self.last_ckpt}" if self.last_ckpt else "no checkpoint was written yet"
            raise TrainingDiverged(f"loss is {loss} at step {self.step + 1}; {where}. Lower train.lr")
        params = [q for q in self.model.parameters() if q.requires_grad]
        norm = self.clip_gradients(params, t.grad_clip if t.grad_clip > 0 else float("inf"))
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        dt = time.perf_counter() - t0
        step_tokens = sum(b["input_ids"].numel() for b in batches)
        self.step += 1
        self.tokens_seen += step_tokens
        self.train_time += dt
        return {"step": self.step, "loss": loss, "lr": lr, "grad_norm": float(norm), "tokens": self.tokens_seen,
                "dt_s": round(dt, 6), "tokens_per_s": round(step_tokens / dt, 2), "mfu": self.mfu(step_tokens / dt),
                "mem_bytes": _mem_bytes(self.device), "pp_bubble": round(self._bubble(res.events), 4)}

    def _bubble(self, events: list) -> float:
        """Measured bubble of the step: 1 - sum of the stages' compute time / (stages x step window)."""
        compute = [e for e in events if e.op in ("F", "B")]
        busy = torch.tensor([sum(e.end - e.start for e in compute)], dtype=torch.float64)
        edges = torch.tensor([-min(e.start for e in compute), max(e.end for e in compute)], dtype=torch.float64)
        dist.all_reduce(busy)
        dist.all_reduce(edges, op=dist.ReduceOp.MAX)
        return 1 - float(busy) / (len(self.pp_ranks) * float(edges.sum()))

    @torch.no_grad()
    def evaluate(self) -> dict[str, float] | None:
        if self.cfg.train.parallel.pp == 1:
            return super().evaluate()
        if self.data.make_val is None:
            return None
        import torch.nn.functional as F

        self.model.eval()
        sums = torch.zeros(4, dtype=torch.float64)  # loss, tokens, loss over byte-bearing tokens, bytes
        n = self.cfg.train.eval_batches
        whole = self.cfg.train.stage == "pretrain" and n == 0
        tb = self.data.token_bytes
        for batch in itertools.islice(self.data.make_val(), None if whole else max(1, n)):
            with self.autocast():
                logits = self.executor.forward_only(batch, torch.float32)
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
        self.model.train()
        dist.broadcast(sums, src=self.pp_ranks[-1])
        val_loss = float(sums[0] / max(float(sums[1]), 1.0))
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 700.0)),
                "val_bpb": float(sums[2] / (math.log(2) * sums[3])) if sums[3] else None}

    def _pp_full_state(self) -> dict[str, torch.Tensor]:
        """The unsharded model state (HF names) from every stage (collective)."""
        mine = {k: v.detach().cpu() for k, v in self.stage.full_named_parameters()}
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        full = {k: v for part in parts for k, v in part.items()}
        return {k: full[k] for k in self.raw_model.state_dict()}

    # ---- sharded checkpoints --------------------------------------------------------------------

    def _model_optim_state(self) -> tuple[dict, dict]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        return get_state_dict(self.model, self.opt)

    def save(self, val_loss: float | None) -> None:
        t, d = self.cfg.train, self.d
        root = self.out / ckpt.CKPT_DIR
        tmp = root / f".tmp-{ckpt.checkpoint_name(self.step)}"
        if d.main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        loaders, rngs = [None] * dist.get_world_size(), [None] * dist.get_world_size()
        dist.all_gather_object(loaders, self.data.train.state_dict())
        dist.all_gather_object(rngs, ckpt.rng_state())
        if t.parallel.fsdp:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            msd, osd = self._model_optim_state()
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp / DCP_DIR))
            full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:  # TP shards / pipeline stages are plain tensors: one file per rank
            torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict()},
                       tmp / f"rank{dist.get_rank()}.pt")
            full = self._pp_full_state() if t.parallel.pp > 1 else full_state_dict(self.model, self.tp_group)
        dist.barrier()
        if d.main:
            if val_loss is not None and (self.best_val is None or val_loss < self.best_val):
                self.best_val = val_loss
            self._write_checkpoint(tmp, full, loaders, rngs, val_loss)
        dist.barrier()

    def _write_checkpoint(self, tmp: Path, full: dict, loaders: list, rngs: list, val_loss: float | None) -> None:
        from lmforge.track.provenance import git_info

        t = self.cfg.train
        state = {"model": full, "scheduler": self.sched.state_dict(), "scaler": self.scaler.state_dict(),
                 "step": self.step, "tokens_seen": self.tokens_seen, "train_time": self.train_time,
                 "loader": loaders, "rng": rngs, "parallel": to_dict(t.parallel), "world_size": len(loaders)}
        with open(tmp / ckpt.STATE, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        shards = {p.name: sha256_file(p) for p in tmp.glob("rank*.pt")}
        meta = {"val_loss": val_loss, "best_val_loss": self.best_val, "tokens_seen": self.tokens_seen,
                "method": t.method, "stage": t.stage, "config": to_dict(self.cfg),
                "model_config": self.model_config.to_hf(dtype="float32"), "git": git_info(),
                "tokenizer_dir": self.data.tokenizer_dir, "step": self.step,
                "state_sha256": sha256_file(tmp / ckpt.STATE), "shard_sha256": shards,
                "dcp_sha256": sha256_dir(tmp / DCP_DIR) if (tmp / DCP_DIR).is_dir() else None}
        atomic_write_json(tmp / ckpt.META, meta)  # last: a folder without it is partial
        final = tmp.parent / ckpt.checkpoint_name(self.step)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        ckpt.prune(final.parent, t.keep_last)
        self.last_ckpt = final

    def _restore(self) -> None:
        found = ckpt.latest_valid(self.out)
        if found is None:
            self.warn(f"--resume: no valid checkpoint in {self.out / ckpt.CKPT_DIR}; starting from step 0")
            return
        path, meta = found
        state = ckpt.load_state(path, map_location="cpu")
        p = self.cfg.train.parallel
        if state.get("world_size") != dist.get_world_size() or state.get("parallel") != to_dict(p):
            raise ConfigError(f"{path} was written by {state.get('world_size')} processes with train.parallel="
                              f"{state.get('parallel')}; resume with the same (now {dist.get_world_size()}, "
                              f"{to_dict(p)})")
        if p.fsdp:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import set_state_dict

            if sha256_dir(path / DCP_DIR) != meta.get("dcp_sha256"):
                raise ckpt.CheckpointError(f"{path / DCP_DIR} does not match the dcp_sha256 in meta.json (corrupt)")
            msd, osd = self._model_optim_state()
            sharded = {"model": msd, "optim": osd}
            dcp.load(sharded, checkpoint_id=str(path / DCP_DIR))
            set_state_dict(self.model, self.opt, model_state_dict=sharded["model"], optim_state_dict=sharded["optim"])
        else:
            name = f"rank{dist.get_rank()}.pt"
            if sha256_file(path / name) != meta.get("shard_sha256", {}).get(name):
                raise ckpt.CheckpointError(f"{path / name} does not match its sha256 in meta.json (corrupt)")
            shard = torch.load(path / name, map_location="cpu", weights_only=False)
            self.model.load_state_dict(shard["model"])
            self.opt.load_state_dict(shard["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.data.train.load_state_dict(state["loader"][dist.get_rank()])
        ckpt.set_rng_state(state["rng"][dist.get_rank()])
        self.step, self.tokens_seen, self.train_time = state["step"], state["tokens_seen"], state["train_time"]
        self.last_ckpt, self.best_val = path, meta.get("best_val_loss")
        dist.barrier()
        if self.d.main:
            for newer in ckpt.list_checkpoints(self.out):
                if newer.name > path.name:
                    shutil.rmtree(newer, ignore_errors=True)
            truncate_metrics(self.out, self.step)
            print(f"resumed from {path} (step {self.step})", file=sys.stderr, flush=True)

    def _static_record(self) -> dict[str, Any]:
        rec = super()._static_record()
        W = dist.get_world_size()
        rec.update(world_size=W, parallel={**to_dict(self.cfg.train.parallel), "dp": self.d.world_size},
                   effective_batch=self.cfg.train.batch_size * self.cfg.train.grad_accum * self.d.world_size)
        rec["effective_batch_tokens"] = rec["effective_batch"] * self.data.seq_len
        return rec
