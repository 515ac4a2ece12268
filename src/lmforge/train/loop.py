"""The trainer: one function, `train(cfg, out)`, for pretraining and SFT, full or LoRA, 1 or N processes.

Each optimizer step takes `grad_accum` micro-batches, runs them under autocast (bfloat16;
float16 with a GradScaler; float32 plain), clips the gradient norm and steps AdamW on a
warmup + cosine/linear schedule. The loss is the mean over *all* target tokens of the step,
across micro-batches and ranks (each micro-batch's summed loss is divided by the step's global
token count), so 2 processes × batch b, 1 process × batch 2b and 1 process × accumulation 2
compute the same number. Evaluation every `eval_every` steps gives val loss, perplexity and
bits per byte. Checkpoints (see `checkpoint.py`) make `resume=True` continue bit for bit:
same losses and same final weights as a run that was never interrupted (CPU, float32).
A NaN/Inf loss stops the run naming the step and the last good checkpoint.

Under `torchrun` it trains with DDP (gloo on CPU, NCCL on CUDA); every rank reads its own
rows and only rank 0 writes. It knows nothing about how batches are made (the data loaders
and `sft_data.py` do) or about the command line (`commands.py`).

    python -m lmforge.train configs/tiny.yaml data.path=runs/packed --out runs/tiny
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from tokenizers import Tokenizer

from lmforge.config import ConfigError, to_dict
from lmforge.data.loader import PackedDataset, PackedLoader, batch_from_rows
from lmforge.model import ModelConfig, Transformer
from lmforge.model.checkpoint import DTYPES
from lmforge.model.config import alignment_warnings
from lmforge.quant import load_pretrained
from lmforge.parallel.distributed import Dist
from lmforge.parallel.parallelize import pipeline_evaluate, pipeline_step, plan_for
from lmforge.perf.hardware import NoPeakError, peak_flops
from lmforge.perf.mfu import mfu, model_flops_per_token
from lmforge.tokenizer.load import load_tokenizer, tokenizer_hash
from lmforge.track.plots import plot_loss_curve
from lmforge.track.progress import StepClock
from lmforge.track.provenance import git_info
from lmforge.track.run import RunDir, peak_memory
from lmforge.track.runs import read_metrics, truncate_metrics

from . import checkpoint as ckpt
from . import guards
from .config import TrainConfig
from .fused_ce import TrainLoss, can_fuse
from .guards import TrainingDiverged
from .lora import apply_lora, base_load_dtype
from .optim import build_optimizer, build_scheduler
from .sft_data import SFTLoader

IGNORE = -100
# Fields every training record.json carries (tests check them; docs/training.md lists them).
RECORD_FIELDS = ("experiment_id", "git", "data_hash", "tokenizer_hash", "config", "stage", "method", "lr",
                 "batch_size", "grad_accum", "world_size", "effective_batch", "effective_batch_tokens",
                 "device", "hardware", "packages", "seed", "final_train_loss", "final_val_loss", "eval",
                 "peak_mem", "wall_time_s", "tokens_per_s", "mfu", "flops_per_token", "peak_flops")


@dataclass
class Data:
    """What the trainer needs to know about its inputs."""
    train: Any
    make_val: Any  # () -> fresh val loader (same rows every eval), or None
    seq_len: int
    vocab_size: int
    data_hash: str | None
    tokenizer_hash: str | None
    tokenizer_dir: str | None
    token_bytes: torch.Tensor | None  # (V,) UTF-8 bytes per token, 0 for specials: bits per byte
    notes: list[str] = field(default_factory=list)


def token_byte_lengths(tokenizer_dir: str) -> torch.Tensor:
    """Bytes each token stands for. Byte-level BPE maps every byte to one character, so the
    length of a token's string is its byte count; added (special/reserved) tokens count 0."""
    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    added = set(tok.get_added_tokens_decoder())
    n = tok.get_vocab_size(with_added_tokens=True)
    return torch.tensor([0 if i in added else len(tok.id_to_token(i) or "") for i in range(n)])


def _find_tokenizer(cfg: TrainConfig, packed: Path | None) -> str | None:
    candidates = [cfg.data.tokenizer]
    if packed is not None and (packed / "config.yaml").is_file():
        candidates.append((yaml.safe_load((packed / "config.yaml").read_text()) or {}).get("tokenizer_dir"))
    candidates.append(cfg.model.init)
    for c in candidates:
        if c and (Path(c) / "tokenizer.json").is_file():
            return str(c)
    return None


def build_data(cfg: TrainConfig, d: Dist, device: torch.device) -> Data:
    t = cfg.train
    if t.stage == "pretrain":
        path = Path(cfg.data.path)
        manifest_path = path / "manifest.json"
        if not manifest_path.is_file():
            raise ConfigError(f"data.path={path}: no manifest.json; make packed shards with `lmforge data pack`")
        manifest = json.loads(manifest_path.read_text())
        train = PackedLoader(str(path), split="train", batch_size=t.batch_size, seed=t.seed, shuffle=True,
                             rank=d.rank, world_size=d.world_size, device=str(device))
        has_val = manifest.get("splits", {}).get("val", {}).get("rows", 0) >= d.world_size
        if not has_val:
            make_val = None
        elif t.eval_batches == 0:  # every val row once, the last batch possibly short: independent of batch_size
            make_val = functools.partial(_all_rows, str(path), "val", t.batch_size, d, str(device))
        else:
            make_val = functools.partial(PackedLoader, str(path), split="val", batch_size=t.batch_size, seed=0,
                                         shuffle=False, rank=d.rank, world_size=d.world_size, device=str(device))
        tok_dir = _find_tokenizer(cfg, path)
        notes = [] if has_val else [f"{path} has no val split: no evaluation"]
        if tok_dir and tokenizer_hash(tok_dir) != manifest.get("tokenizer_hash"):
            raise ConfigError(f"tokenizer {tok_dir} is not the one {path} was packed with "
                              f"(tokenizer_hash differs); set data.tokenizer to the right folder")
        return Data(train, make_val, int(manifest["seq_len"]), int(manifest["vocab_size"]), manifest.get("data_hash"),
                    manifest.get("tokenizer_hash"), tok_dir,
                    token_byte_lengths(tok_dir) if tok_dir else None, notes)

    tok_dir = _find_tokenizer(cfg, None)
    if tok_dir is None:
        raise ConfigError("sft: no tokenizer.json in data.tokenizer or model.init; set data.tokenizer=DIR")
    tok = load_tokenizer(tok_dir)

    def loader(path: str, seed: int) -> Any:
        return SFTLoader(path, tok, seq_len=t.seq_len, batch_size=t.batch_size, seed=seed, packed=cfg.sft.packed,
                         rank=d.rank, world_size=d.world_size, device=str(device))

    train = loader(cfg.data.path, t.seed)
    make_val = (lambda: loader(cfg.data.val_path, 0)) if cfg.data.val_path else None
    return Data(train, make_val, t.seq_len, len(tok), getattr(train, "data_hash", None), tokenizer_hash(tok_dir),
                tok_dir, token_byte_lengths(tok_dir), [] if make_val else ["no data.val_path: no evaluation"])


def _all_rows(path: str, split: str, batch_size: int, d: Dist, device: str) -> Any:
    """Batches of every row of a packed split exactly once (this rank's rows: `r::world_size`), in order."""
    ds = PackedDataset(path, split)
    mine = list(range(d.rank, ds.num_rows, d.world_size))
    for lo in range(0, len(mine), batch_size):
        rows_BT1 = np.stack([ds.row(i) for i in mine[lo:lo + batch_size]])
        yield {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.int64)).to(device)
               for k, v in batch_from_rows(rows_BT1, ds.eos_token_id).items()}


def build_model(cfg: TrainConfig, data: Data, device: torch.device | None = None) -> Transformer:
    m = cfg.model
    if m.init:
        dtype = "float32"
        if cfg.train.method != "full":  # a light LoRA base is built from a 16-bit checkpoint as stored

            dtype = base_load_dtype(m.init, cfg.lora, device or torch.device("cpu"))
        return load_pretrained(m.init, dtype=dtype, device="cpu").train()
    vocab = m.vocab_size or data.vocab_size
    if vocab < data.vocab_size:
        raise ConfigError(f"model.vocab_size={vocab} is smaller than the data's vocabulary ({data.vocab_size})")
    config = ModelConfig(vocab_size=vocab, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                         num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
                         num_key_value_heads=m.num_key_value_heads, head_dim=m.head_dim,
                         max_position_embeddings=m.max_position_embeddings or data.seq_len,
                         rope_theta=m.rope_theta, rms_norm_eps=m.rms_norm_eps,
                         tie_word_embeddings=m.tie_word_embeddings, model_type=m.model_type,
                         initializer_range=m.initializer_range, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    return Transformer(config).init_weights(cfg.train.seed).train()


def apply_method(cfg: TrainConfig, model: Transformer) -> torch.nn.Module:
    if cfg.train.method == "full":
        return model

    return apply_lora(model, cfg.lora)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    """Pretrain / SFT; a stage with another loss (`dpo.DPOTrainer`) overrides `make_data`, `forward_module`,
    `forward_backward` and `evaluate`, and keeps the rest: model and LoRA, parallelism, optimizer, checkpoints,
    resume, record."""

    def __init__(self, cfg: TrainConfig, out: Path, resume: bool = False, overwrite: bool = False):
        self.par = plan_for(cfg)  # checks the parallel options before anything starts
        self.cfg, self.out = cfg.validate(), Path(out)
        t = cfg.train
        self.determinism = guards.set_deterministic(t.deterministic)  # before CUDA initialises
        self.d, self.device = self.par.setup(t.device)
        self.warnings: list[str] = []
        self.mfu_error: str | None = None
        if self.device.type == "cuda" and t.dtype == "float32":
            torch.backends.cuda.matmul.allow_tf32 = True  # tensor cores for fp32 matmuls; MFU uses the tf32 peak
            torch.backends.cudnn.allow_tf32 = True
        seed_everything(t.seed)
        self.run = self._open_run(resume, overwrite) if self.d.main else None
        self.data = self.make_data()
        for note in self.data.notes:
            self.warn(note)
        self.shape = guards.shape_for(cfg, self.data.vocab_size)
        if t.preflight and not t.parallel.active:  # sharded runs: the parallel scan estimates per rank
            guards.preflight_train(cfg, self.shape, self.data.seq_len, self.device)
        self.spikes = guards.SpikeDetector(t.spike_zscore) if t.spike_zscore > 0 else None
        self.raw_model = build_model(cfg, self.data, self.device)
        self.model_config = self.raw_model.config
        for msg in alignment_warnings(self.model_config):
            self.warn(msg)
        self.model = self.par.parallelize(apply_method(cfg, self.raw_model).to(self.device), self.raw_model, cfg)
        if t.gradient_checkpointing:
            self.raw_model.model.gradient_checkpointing = True
        self.opt = build_optimizer(self.model, t, self.device)
        self.sched = build_scheduler(self.opt, t)
        self.amp_dtype = DTYPES[t.dtype]
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=t.dtype == "float16")
        self.step, self.tokens_seen, self.train_time = 0, 0, 0.0
        self.best_val: float | None = None
        self.checkpointer = self._checkpointer()
        if resume:
            self._restore()
        self.fused = t.fused_loss and can_fuse(self.model)
        self.fwd = self.par.wrap_data_parallel(self.forward_module())
        if t.compile:
            self.fwd = torch.compile(self.fwd)
        self.train_iter = iter(self.data.train)
        self.flops_per_token, self.peak = self._flops()
        if self.par.note:
            self.warn(self.par.note)

    # ---- setup helpers ----------------------------------------------------------------------

    @property
    def last_ckpt(self) -> Path | None:
        """The newest checkpoint this run wrote or resumed from (the checkpointer keeps it; rank 0 after a save)."""
        return self.checkpointer.last

    def make_data(self) -> Data:
        return build_data(self.cfg, self.d, self.device)

    def forward_module(self) -> torch.nn.Module:
        """What DDP and compile wrap: the summed loss without full logits (`TrainLoss`), or the model."""
        return TrainLoss(self.model) if self.fused else self.model

    def warn(self, msg: str) -> None:
        if self.d.main:
            print(f"warning: {msg}", file=sys.stderr, flush=True)
            self.warnings.append(msg)

    def _open_run(self, resume: bool, overwrite: bool) -> RunDir:
        if not resume and not overwrite and ckpt.list_checkpoints(self.out):
            raise ConfigError(f"{self.out} already holds checkpoints; pass --resume to continue that run "
                              f"or --overwrite to start again")
        if overwrite:
            shutil.rmtree(self.out / ckpt.CKPT_DIR, ignore_errors=True)
        run = RunDir(self.out, overwrite=overwrite, resume=resume)
        run.write_config(self.cfg)
        return run

    def _flops(self) -> tuple[float, float | None]:
        fpt = model_flops_per_token(self.model_config, self.data.seq_len)
        dtype = "tf32" if self.device.type == "cuda" and self.cfg.train.dtype == "float32" else self.cfg.train.dtype
        try:
            return fpt, peak_flops(str(self.device), dtype)
        except NoPeakError as e:
            self.warn(f"mfu is null: {e} (run `lmforge doctor` to measure this machine's peak)")
            return fpt, None

    def _checkpointer(self) -> ckpt.Checkpointer:
        """The run's state as components: what the parallelism plan says for the model and optimizer
        (plain, or shards beside an unsharded copy), then schedule, scaler, counters, per-rank loader
        position and RNG streams."""
        parts = self.par.checkpoint_parts(self.model, self.raw_model, self.opt)
        components = {**parts["components"], "scheduler": self.sched, "scaler": self.scaler,
                      "counters": ckpt.Attributes(self, ("step", "tokens_seen", "train_time")),
                      "loader": self.data.train, "rng": ckpt.RNGState(), **parts["extra"]}
        t = self.cfg.train
        return ckpt.Checkpointer(self.out, components, t.ckpt_every, t.keep_last, per_rank=("loader", "rng"),
                                 flat=("counters", "layout"), shards=parts["shards"], validate=parts["validate"])

    def _restore(self) -> None:
        found = self.checkpointer.restore()
        if found is None:
            self.warn(f"--resume: no valid checkpoint in {self.out / ckpt.CKPT_DIR}; starting from step 0")
            if self.d.main:  # every logged step runs again: none may appear twice
                truncate_metrics(self.out, 0)
            return
        path, meta = found
        self.best_val = meta.get("best_val_loss")
        if self.d.main:
            truncate_metrics(self.out, self.step)
            print(f"resumed from {path} (step {self.step})", file=sys.stderr, flush=True)

    # ---- the loop ---------------------------------------------------------------------------

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype != torch.float32)

    def loss_sum(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed next-token cross-entropy over the batch's target tokens (labels != -100)."""
        with self.autocast():
            if self.fused:  # `model` is (a wrapper of) TrainLoss: the summed loss without full logits
                return model(batch["input_ids"], batch["labels"], batch.get("position_ids"), batch.get("doc_ids"))
            return token_losses(model, batch).sum()

    def train_step(self) -> dict[str, float]:
        t = self.cfg.train
        t0 = time.perf_counter()
        loader_state = self.data.train.state_dict() if self.spikes else None
        batches = [next(self.train_iter) for _ in range(t.grad_accum)]
        loss, extra = self.forward_backward(batches)
        if not math.isfinite(loss):
            where = f"the last good checkpoint is {self.last_ckpt}" if self.last_ckpt else "no checkpoint was written yet"
            raise TrainingDiverged(f"loss is {loss} at step {self.step + 1}; {where}. "
                                   f"Lower train.lr, raise train.warmup_steps or use train.dtype=bfloat16/float32")
        self.scaler.unscale_(self.opt)
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = self.par.clip_gradients(self.model, params, t.grad_clip if t.grad_clip > 0 else float("inf"))
        lr = self.opt.param_groups[0]["lr"]
        spikes = self.check_spikes(loss, float(grad_norm), loader_state)
        if not (spikes and t.skip_spikes):
            self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        step_tokens = sum(b["input_ids"].numel() for b in batches) * self.d.world_size
        self.step += 1
        self.tokens_seen += step_tokens
        self.train_time += dt
        tps = step_tokens / dt
        return {"step": self.step, "loss": loss, "lr": lr, "grad_norm": float(grad_norm),
                "tokens": self.tokens_seen, "dt_s": round(dt, 6), "tokens_per_s": round(tps, 2),
                "mfu": self.mfu(tps), "mem_bytes": guards.mem_bytes(self.device), **extra,
                **({"spike": [s.metric for s in spikes], "skipped": t.skip_spikes} if spikes else {})}

    def forward_backward(self, batches: list[dict[str, torch.Tensor]]) -> tuple[float, dict[str, Any]]:
        """Backward of the step's loss over its micro-batches (gradients accumulate); (the loss, extra metrics)."""
        local_tokens = sum(int((b["labels"] != IGNORE).sum()) for b in batches)
        (n_tokens,) = self.d.all_sum(local_tokens)
        n_tokens = max(n_tokens, 1.0)
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(batches):
            with self.sync_context(i == len(batches) - 1):
                loss_sum = self.loss_sum(self.fwd, batch)
                # DDP averages gradients over ranks; scaling by world_size makes that a global token mean.
                self.scaler.scale(loss_sum * (self.d.world_size / n_tokens)).backward()
            total += loss_sum.detach()
        (loss_total,) = self.d.all_sum(total.item())
        return loss_total / n_tokens, {}

    def sync_context(self, last: bool) -> contextlib.AbstractContextManager:
        """DDP's gradient all-reduce only on the step's last micro-batch."""
        if last or not isinstance(self.fwd, torch.nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext()
        return self.fwd.no_sync()

    def check_spikes(self, loss: float, grad_norm: float, loader_state: dict | None) -> list:
        spikes = self.spikes.check(self.step + 1, loss=loss, grad_norm=grad_norm) if self.spikes else []
        for s in spikes:
            s.rows = guards.batch_rows(self.data.train, loader_state)
            self.warn(s.message() + (": update skipped (train.skip_spikes=true)" if self.cfg.train.skip_spikes else ""))
        return spikes

    def mfu(self, tokens_per_s: float) -> float | None:
        if self.peak is None:
            return None
        try:
            return round(mfu(self.flops_per_token, tokens_per_s, self.peak * self.d.world_size), 6)
        except ValueError as e:  # > 100%: the peak is wrong (e.g. measured on a busy machine); never a figure
            if not self.mfu_error:
                self.mfu_error = str(e)
                self.warn(f"mfu is null: {e}. Rerun `lmforge doctor` on an idle machine")
            return None

    @torch.no_grad()
    def evaluate(self) -> dict[str, float] | None:
        if self.data.make_val is None:
            return None
        self.model.eval()
        loss_sum = n_tokens = byte_loss = n_bytes = 0.0
        tb = self.data.token_bytes.to(self.device) if self.data.token_bytes is not None else None
        n = self.cfg.train.eval_batches
        whole = self.cfg.train.stage == "pretrain" and n == 0  # make_val gives every val row once, then stops
        for batch in itertools.islice(self.data.make_val(), None if whole else max(1, n)):
            with self.autocast():
                loss_N = token_losses(self.model, batch).flatten()
            labels = batch["labels"].flatten()
            valid = labels != IGNORE
            loss_sum += float(loss_N.sum())
            n_tokens += float(valid.sum())
            if tb is not None:  # bits per byte (nanochat's definition): specials count neither loss nor bytes
                nb = tb[labels.clamp(min=0)] * valid
                byte_loss += float((loss_N * (nb > 0)).sum())
                n_bytes += float(nb.sum())
        self.model.train()
        loss_sum, n_tokens, byte_loss, n_bytes = self.d.all_sum(loss_sum, n_tokens, byte_loss, n_bytes)
        val_loss = loss_sum / max(n_tokens, 1.0)
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 700.0)),
                "val_bpb": byte_loss / (math.log(2) * n_bytes) if n_bytes else None}

    def save(self, val_loss: float | None) -> None:
        """Checkpoint this step (collective); rank 0 also tracks the best val loss."""
        t = self.cfg.train

        def meta() -> dict[str, Any]:  # rank 0 only
            if val_loss is not None and (self.best_val is None or val_loss < self.best_val):
                self.best_val = val_loss
            return {"val_loss": val_loss, "best_val_loss": self.best_val, "tokens_seen": self.tokens_seen,
                    "method": t.method, "stage": t.stage, "config": to_dict(self.cfg),
                    "model_config": self.model_config.to_hf(dtype="float32"), "git": git_info(),
                    "tokenizer_dir": self.data.tokenizer_dir}

        self.checkpointer.save(self.step, meta)

    def fit(self) -> dict[str, Any]:
        t, d = self.cfg.train, self.d
        if d.main:
            self.run.write_record(self._static_record())
        last_train_loss, last_eval = None, None
        clock = StepClock(self.step, t.max_steps)
        while self.step < t.max_steps:
            try:
                row = pipeline_step(self) if self.par.pipelined else self.train_step()
            except (torch.OutOfMemoryError, RuntimeError) as e:
                if not guards.is_oom(e):
                    raise
                mem = peak_memory()
                raise guards.TrainingOOM(guards.oom_message(
                    e, self.cfg, self.shape, self.data.seq_len, self.device.type,
                    mem.get("cuda_max_allocated_bytes", mem["cpu_max_rss_bytes"]), self.step)) from e
            if t.compile and self.step == 1 and d.main:  # dynamo has traced the step: what broke the graph
                breaks = guards.graph_breaks()
                self.run.write_record({"compile": breaks})
                if breaks["count"]:
                    self.warn(f"torch.compile: {breaks['count']} graph break(s): {'; '.join(breaks['reasons'][:3])}")
            last_train_loss = row["loss"]
            done = self.step == t.max_steps
            val_loss = None
            if done or (t.eval_every and self.step % t.eval_every == 0):
                t_eval = time.perf_counter()
                ev = pipeline_evaluate(self) if self.par.pipelined else self.evaluate()
                if ev is not None:
                    row.update(ev, eval_s=round(time.perf_counter() - t_eval, 6))
                    last_eval, val_loss = ev, ev["val_loss"]
            if self.checkpointer.due(self.step, done):
                self.save(val_loss)
            if d.main:
                self.run.log_metrics(row)
                if t.log_every and (self.step % t.log_every == 0 or done or "val_loss" in row):
                    print(f"{_format_row(row, t.max_steps)} | {clock.eta(self.step)}", flush=True)
                if t.target_val_loss is not None and val_loss is not None and val_loss <= t.target_val_loss:
                    hit = target_reached(read_metrics(self.out), t.target_val_loss)
                    if hit["step"] == self.step:  # the first evaluation at or below it, also after a resume
                        print(f"val_loss {val_loss:.4f} <= target {t.target_val_loss} at step {hit['step']}: "
                              f"{hit['train_s']:.1f} s of training ({hit['train_plus_eval_s']:.1f} s with "
                              f"evaluation), {hit['tokens']:,} tokens", flush=True)
        return self._finish(last_train_loss, last_eval)

    # ---- the record -------------------------------------------------------------------------

    def _static_record(self) -> dict[str, Any]:
        t = self.cfg.train
        eff = t.batch_size * t.grad_accum * self.d.world_size
        rec = {"experiment_id": self.cfg.run.name or self.out.name, "stage": t.stage, "method": t.method,
                "config": to_dict(self.cfg), "data_hash": self.data.data_hash,
                "tokenizer_hash": self.data.tokenizer_hash, "tokenizer_dir": self.data.tokenizer_dir,
                "lr": t.lr, "batch_size": t.batch_size, "grad_accum": t.grad_accum, "world_size": self.d.world_size,
                "effective_batch": eff, "effective_batch_tokens": eff * self.data.seq_len, "seq_len": self.data.seq_len,
                "dtype": t.dtype, "device": str(self.device), "seed": t.seed,
                "model_config": self.model_config.to_hf(dtype="float32"),
                "num_parameters": self.raw_model.num_parameters(),
                "trainable_parameters": sum(p.numel() for p in self.model.parameters() if p.requires_grad),
                "flops_per_token": self.flops_per_token, "peak_flops": self.peak,
                "determinism": self.determinism,
                "memory_estimate": None if t.parallel.active else self._memory_estimate()}
        return self.par.update_record(rec, self.cfg, self.data.seq_len)

    def _memory_estimate(self) -> dict[str, Any]:
        """The pre-flight's estimate of this run (`guards.memory_args`: what `perf.estimate.memory` was given),
        so a report can set the measured peak beside it without re-deriving the run's dtypes."""
        kind = self.device.type
        args = guards.memory_args(self.cfg, self.shape, self.data.seq_len, kind)
        est = guards.train_estimate(self.cfg, self.shape, self.data.seq_len, kind)
        return {"args": {k: list(v) if isinstance(v, tuple) else v for k, v in args.items()},
                "total_bytes": est.total, "overhead_bytes": est.overhead}

    def _finish(self, train_loss: float | None, last_eval: dict | None) -> dict[str, Any]:
        if not self.d.main:
            return {}
        metrics = read_metrics(self.out)
        timed = [m for m in metrics if "dt_s" in m][1:] or [m for m in metrics if "dt_s" in m]  # step 1 warms up
        seconds = sum(m["dt_s"] for m in timed)
        tps = sum(m["tokens_per_s"] * m["dt_s"] for m in timed) / seconds if seconds else None
        if train_loss is None and metrics:
            train_loss = metrics[-1].get("loss")
        evals = [m for m in metrics if "val_loss" in m]
        last_eval = last_eval or ({k: evals[-1][k] for k in ("val_loss", "val_ppl", "val_bpb")} if evals else None)
        mem = peak_memory()
        target = self.cfg.train.target_val_loss
        results = {"final_train_loss": train_loss, "final_val_loss": (last_eval or {}).get("val_loss"),
                   "eval": last_eval or {}, "steps": self.step, "tokens_seen": self.tokens_seen,
                   "train_time_s": round(self.train_time, 3), "tokens_per_s": round(tps, 2) if tps else None,
                   "mfu": self.mfu(tps) if tps else None, "peak_mem": mem.get("cuda_max_allocated_bytes",
                                                                           mem["cpu_max_rss_bytes"]),
                   "mfu_error": self.mfu_error, "best_val_loss": self.best_val,
                   "target_val_loss": target,
                   "target_reached": target_reached(metrics, target) if target is not None else None,
                   "last_checkpoint": str(self.last_ckpt) if self.last_ckpt else None,
                   "warnings": self.warnings}
        self.run.write_record(results)
        try:
            results["loss_curve"] = str(plot_loss_curve(self.out))
        except Exception as e:  # a missing plot must not fail a finished training run
            self.warn(f"loss curve not drawn: {e}")
        self.run.finish(**results)
        return self.run.read_record()


def target_reached(metrics: list[dict], target: float) -> dict[str, Any] | None:
    """The first evaluation with val_loss <= target: its step, tokens seen, training seconds (the sum of
    the step times up to it, evaluations excluded) and the same plus the evaluations' seconds; None if
    never. Read from metrics.jsonl, so a resumed run reports the same as an uninterrupted one."""
    train_s = eval_s = 0.0
    for m in metrics:
        train_s += m.get("dt_s", 0.0)
        eval_s += m.get("eval_s", 0.0)
        if m.get("val_loss") is not None and m["val_loss"] <= target:
            return {"step": m["step"], "tokens": m["tokens"], "val_loss": m["val_loss"],
                    "train_s": round(train_s, 3), "train_plus_eval_s": round(train_s + eval_s, 3)}
    return None


def token_losses(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-token next-token cross-entropy (B, T) in float32; 0 where labels == -100. Packed rows are
    masked per document and positions restart per document (`doc_ids`, `position_ids`)."""
    logits_BTV = model(batch["input_ids"], position_ids=batch.get("position_ids"), doc_ids=batch.get("doc_ids"))
    labels_BT = batch["labels"]
    loss_N = F.cross_entropy(logits_BTV.float().flatten(0, 1), labels_BT.flatten(), ignore_index=IGNORE,
                             reduction="none")
    return loss_N.view_as(labels_BT)


def _format_row(row: dict, max_steps: int) -> str:
    parts = [f"step {row['step']}/{max_steps}", f"loss {row['loss']:.4f}", f"lr {row['lr']:.2e}",
             f"gnorm {row['grad_norm']:.3f}", f"{row['tokens_per_s']:,.0f} tok/s"]
    if row.get("mfu") is not None:
        parts.append(f"mfu {row['mfu']:.1%}")
    if "val_loss" in row:
        parts.append(f"val {row['val_loss']:.4f}" + (f" bpb {row['val_bpb']:.3f}" if row.get("val_bpb") else ""))
    return " | ".join(parts)


def fit_recording_failure(trainer: Trainer) -> dict[str, Any]:
    """`trainer.fit()`; a run that raises leaves `status: failed`, the error and its last checkpoint in
    record.json (every stage that trains through a `Trainer` ends this way)."""
    try:
        return trainer.fit()
    except BaseException as e:
        if trainer.run is not None:
            trainer.run.write_record({"status": "failed", "error": f"{type(e).__name__}: {e}",
                                      "last_checkpoint": str(trainer.last_ckpt) if trainer.last_ckpt else None})
        raise


def train(cfg: TrainConfig, out: str | os.PathLike, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Pretrain or fine-tune `cfg` (any parallelism) into run directory `out`; returns the final record
    (rank 0) or {} (other ranks). GRPO is its own stage (`grpo.trainer.train_grpo`; `commands.run` chooses)."""
    if cfg.train.stage in ("grpo", "dpo"):
        raise ConfigError(f"train.stage={cfg.train.stage} runs through lmforge.train.commands.run")
    return fit_then_leave(lambda: Trainer(cfg, Path(out), resume=resume, overwrite=overwrite))


def fit_then_leave(make_trainer: Callable[[], Any]) -> dict[str, Any]:
    """Build and fit a trainer (`fit_recording_failure`), then leave the process group whatever happened: a
    gloo group left to the interpreter's exit can abort a torchrun rank after its run finished (SIGABRT,
    "terminate called without an active exception"), which fails the whole launch."""
    try:
        return fit_recording_failure(make_trainer())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
