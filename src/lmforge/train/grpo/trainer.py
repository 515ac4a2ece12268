"""The GRPO stage: sample groups of answers with the engine, score them, push the policy toward the better ones.

One step (`GRPOTrainer.step`):

    tasks    = TaskSampler.next_batch()                    prompts_per_step task rows
    rollouts = RolloutEngine.generate(prompts, step)       group_size samples each, engine log-probs
    rewards  = Rewards(completions, tasks)                 per component, and the weighted total
    A        = group_advantages(total, group_size)         relative to each task's own group
    for epoch in grpo.epochs, for minibatch in grpo.minibatches:
        loss = grpo_loss(policy log-probs, engine log-probs, A, ...)  -> backward, clip, AdamW step
    RolloutEngine.load_weights(model)                      the engine samples from the new policy next step

Trainer state is the sum of components that each save and load their own state (torchtitan's
`Stateful` pattern): the model, the optimizer, the lr schedule, the task sampler and the progress
counters; `Checkpointer` assembles them into one checkpoint (`train/checkpoint.py`'s format, so
`lmforge export` reads a GRPO run like any other) and owns the interval. Rollouts are seeded by
(seed, step, task), so `--resume` after a kill redraws the same rollouts from the same weights and
the losses continue bit for bit (CPU, float32).

Writes into the run directory: metrics.jsonl (one line per step: reward mean/std per component,
accuracy, format rate, KL, clip fraction, entropy, response length mean/max, rollout and update
tokens/s, seconds in rollout, update and weight sync, engine-vs-trainer log-prob gap), record.json,
config.yaml, checkpoints/ and reward.png. It knows nothing about the command line.

    lmforge train configs/grpo.yaml model.init=runs/reasoning/sft-model data.path=runs/reasoning/train.jsonl

Shape legend: N samples (tasks x group) of a step, L longest prompt + completion, V vocabulary.
"""

from __future__ import annotations

import copy
import math
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.config import ConfigError, to_dict
from lmforge.data.synth import read_tasks
from lmforge.eval.backends import model_hash
from lmforge.tasks.reasoning import ReasoningFormat
from lmforge.model import resolve_device
from lmforge.quant import load_pretrained
from lmforge.tokenizer.load import tokenizer_hash
from lmforge.track.io import sha256_file
from lmforge.track.plots import _pyplot
from lmforge.track.progress import StepClock
from lmforge.track.provenance import git_info
from lmforge.track.run import RunDir, peak_memory
from lmforge.track.runs import read_metrics, truncate_metrics

from .. import checkpoint as ckpt
from ..config import TrainConfig
from ..optim import build_optimizer, build_scheduler
from .loss import completion_logprobs, grpo_loss, group_advantages
from .reward import Rewards
from .rollout import Rollout, RolloutEngine


class TaskSampler:
    """`per_step` tasks per step, every task once per epoch in a seeded permutation, epochs chained."""

    def __init__(self, tasks: list[dict[str, Any]], per_step: int, seed: int):
        if per_step > len(tasks):
            raise ConfigError(f"grpo.prompts_per_step={per_step} is more than the {len(tasks)} tasks in data.path")
        self.tasks, self.per_step, self.seed = tasks, per_step, seed
        self.epoch, self.pos = 0, 0

    def _order(self) -> np.ndarray:
        return np.random.default_rng(self.seed + self.epoch).permutation(len(self.tasks))

    def next_batch(self) -> list[dict[str, Any]]:
        if self.pos + self.per_step > len(self.tasks):  # the epoch's tail is skipped, as SFTLoader does
            self.epoch, self.pos = self.epoch + 1, 0
        idx = self._order()[self.pos:self.pos + self.per_step]
        self.pos += self.per_step
        return [self.tasks[int(i)] for i in idx]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed, "num_tasks": len(self.tasks)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["seed"], state["num_tasks"]) != (self.seed, len(self.tasks)):
            raise ConfigError(f"checkpoint's task sampler had seed {state['seed']} over {state['num_tasks']} tasks; "
                              f"this run has seed {self.seed} over {len(self.tasks)}: resume with the same data")
        self.epoch, self.pos = state["epoch"], state["pos"]


class Progress:
    """Counters that must survive a resume."""

    def __init__(self):
        self.step, self.rollout_tokens, self.train_time = 0, 0, 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "rollout_tokens": self.rollout_tokens, "train_time": self.train_time}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.rollout_tokens, self.train_time = state["step"], state["rollout_tokens"], state["train_time"]


def _batch(rollouts: list[Rollout], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded prompt+completion rows; targets/mask/engine log-probs aligned to logits[:, :-1]."""
    L = max(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
    N = len(rollouts)
    input_ids = torch.full((N, L), pad_id, dtype=torch.long)
    mask = torch.zeros(N, L - 1, dtype=torch.bool)
    old = torch.zeros(N, L - 1)
    for i, r in enumerate(rollouts):
        P, C = len(r.prompt_ids), len(r.completion_ids)
        input_ids[i, :P + C] = torch.tensor(r.prompt_ids + r.completion_ids)
        mask[i, P - 1:P + C - 1] = True  # logits at position P-1+k predict completion token k
        old[i, P - 1:P + C - 1] = torch.tensor(r.logprobs, dtype=torch.float32)
    return {"input_ids": input_ids.to(device), "mask": mask.to(device), "old_logp": old.to(device)}


def _policy_logprobs(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits_NLV = model(input_ids)
    return completion_logprobs(logits_NLV[:, :-1], input_ids[:, 1:])


class GRPOTrainer:
    def __init__(self, cfg: TrainConfig, out: Path, resume: bool = False, overwrite: bool = False):
        self.cfg, self.out, t, g = cfg.validate(), Path(out), cfg.train, cfg.grpo
        self.device = resolve_device(t.device)
        if not resume and not overwrite and ckpt.list_checkpoints(self.out):
            raise ConfigError(f"{self.out} already holds checkpoints; pass --resume to continue that run "
                              f"or --overwrite to start again")
        if overwrite:
            shutil.rmtree(self.out / ckpt.CKPT_DIR, ignore_errors=True)
        self.run = RunDir(self.out, overwrite=overwrite, resume=resume)
        self.run.write_config(cfg)
        self.tasks = read_tasks(cfg.data.path)
        self.data_hash = sha256_file(cfg.data.path)
        init = cfg.model.init
        # the engine first: it seeds torch's global generator when it starts
        self.engine = RolloutEngine(init, str(self.device), g.group_size, g.max_tokens, g.temperature, g.top_p, t.seed)
        torch.manual_seed(t.seed)
        self.model = load_pretrained(init, dtype="float32", device=str(self.device)).train()
        self.ref = copy.deepcopy(self.model).eval().requires_grad_(False) if g.beta > 0 else None
        self.opt = build_optimizer(self.model, t, self.device)
        self.sched = build_scheduler(self.opt, t)
        fmt = ReasoningFormat(g.think_open, g.think_close, g.answer_prefix)
        self.rewards = Rewards(g.rewards, g.reward_weights, fmt)
        self.sampler = TaskSampler(self.tasks, g.prompts_per_step, t.seed)
        self.progress = Progress()
        pad = self.engine.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else 0
        self.meta = {"stage": "grpo", "method": "full", "config": to_dict(cfg), "val_loss": None, "best_val_loss": None,
                     "model_config": self.model.config.to_hf(dtype="float32"), "git": git_info(), "tokenizer_dir": init}
        self.checkpointer = ckpt.Checkpointer(self.out, {"model": self.model, "optimizer": self.opt,
                                                         "scheduler": self.sched, "tasks": self.sampler,
                                                         "progress": self.progress, "rng": ckpt.RNGState()},
                                              t.ckpt_every, t.keep_last)
        if resume:
            if self.checkpointer.restore() is None:
                print(f"warning: --resume: no valid checkpoint in {self.out / ckpt.CKPT_DIR}; starting from step 0")
            truncate_metrics(self.out, self.progress.step)  # the restored step, or 0
            self.engine.load_weights(self.model)

    # ---- one step -------------------------------------------------------------------------------

    def step(self) -> dict[str, Any]:
        g, t = self.cfg.grpo, self.cfg.train
        step = self.progress.step + 1
        t0 = time.perf_counter()
        tasks = self.sampler.next_batch()
        rollouts = self.engine.generate([x["prompt"] for x in tasks], step)
        t_rollout = time.perf_counter() - t0
        row_tasks = [tasks[r.task_index] for r in rollouts]
        texts = [r.text for r in rollouts]
        parts, totals = self.rewards(texts, row_tasks)
        accuracy, format_rate = self.rewards.accuracy_and_format(texts, row_tasks)
        adv_N = group_advantages(torch.tensor(totals), g.group_size, g.scale_rewards).to(self.device)
        t1 = time.perf_counter()
        stats = self._update(_batch(rollouts, self.pad_id, self.device), adv_N)
        t_update = time.perf_counter() - t1
        t_sync = self.engine.load_weights(self.model)
        lengths = [len(r.completion_ids) for r in rollouts]
        n_gen, n_all = sum(lengths), sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
        dt = time.perf_counter() - t0
        self.progress.step, self.progress.rollout_tokens = step, self.progress.rollout_tokens + n_gen
        self.progress.train_time += dt
        row = {"step": step, "reward_mean": float(np.mean(totals)), "reward_std": float(np.std(totals)),
               **{f"reward/{k}_mean": float(np.mean(v)) for k, v in parts.items()},
               **{f"reward/{k}_std": float(np.std(v)) for k, v in parts.items()},
               "accuracy": accuracy, "format_rate": format_rate, **stats,
               "response_len_mean": float(np.mean(lengths)), "response_len_max": int(max(lengths)),
               "truncated_frac": sum(r.finish_reason == "length" for r in rollouts) / len(rollouts),
               "rollout_tokens": n_gen, "rollout_tokens_per_s": round(n_gen / t_rollout, 2),
               "update_tokens_per_s": round(n_all * g.epochs / t_update, 2),
               "rollout_s": round(t_rollout, 4), "update_s": round(t_update, 4), "sync_s": round(t_sync, 4),
               "dt_s": round(dt, 4), "lr": stats.pop("lr")}
        return row

    def _update(self, batch: dict[str, torch.Tensor], adv_N: torch.Tensor) -> dict[str, Any]:
        g, t = self.cfg.grpo, self.cfg.train
        N = batch["input_ids"].shape[0]
        ref_logp = None
        if self.ref is not None:
            with torch.no_grad():
                ref_logp, _ = _policy_logprobs(self.ref, batch["input_ids"])
        clip_high = g.clip_eps_high if g.clip_eps_high is not None else g.clip_eps
        sums = {"tokens": 0.0, "clipped": 0.0, "ratio": 0.0, "kl": 0.0, "entropy": 0.0}
        losses, norms, lr, gap = [], [], self.opt.param_groups[0]["lr"], None
        size = N // g.minibatches
        for epoch in range(g.epochs):
            for lo in range(0, N, size):
                mb = slice(lo, lo + size)
                mask = batch["mask"][mb]
                logp, entropy = _policy_logprobs(self.model, batch["input_ids"][mb])
                if gap is None:  # before any update of this step: the engine's and our log-probs of one policy
                    gap = float(((logp.detach() - batch["old_logp"][mb]).abs() * mask).max())
                loss, st = grpo_loss(logp, batch["old_logp"][mb], adv_N[mb], mask, g.clip_eps, clip_high, g.beta,
                                     None if ref_logp is None else ref_logp[mb], g.loss_agg, max_len=g.max_tokens)
                loss.backward()
                params = [p for p in self.model.parameters() if p.requires_grad]
                norms.append(float(torch.nn.utils.clip_grad_norm_(params, t.grad_clip if t.grad_clip > 0 else math.inf)))
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
                losses.append(float(loss.detach()))
                if epoch == 0:  # the statistics of the rollouts' own policy pass
                    for k in ("tokens", "clipped", "ratio", "kl"):
                        sums[k] += float(st[k])
                    sums["entropy"] += float((entropy.detach() * mask).sum())
        self.sched.step()
        if not all(math.isfinite(x) for x in losses):
            raise FloatingPointError(f"GRPO loss is {losses} at step {self.progress.step + 1}; last good checkpoint: "
                                     f"{self.checkpointer.last}. Lower train.lr")
        n = max(sums["tokens"], 1.0)
        return {"loss": losses[-1], "loss_first": losses[0], "grad_norm": norms[-1], "lr": lr,
                "clip_frac": sums["clipped"] / n, "ratio_mean": sums["ratio"] / n,
                "kl": sums["kl"] / n if self.ref is not None else None, "entropy": sums["entropy"] / n,
                "logprob_gap_max": gap}

    # ---- the run ----------------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        t = self.cfg.train
        self.run.write_record(self._static_record())
        clock = StepClock(self.progress.step, t.max_steps)
        while self.progress.step < t.max_steps:
            row = self.step()
            self.run.log_metrics(row)
            done = self.progress.step == t.max_steps
            if self.checkpointer.due(self.progress.step, done):
                self.checkpointer.save(self.progress.step, lambda: self.meta)
            if t.log_every and (self.progress.step % t.log_every == 0 or done):
                print(f"{_format_row(row, t.max_steps)} | {clock.eta(self.progress.step)}", flush=True)
        return self._finish()

    def _static_record(self) -> dict[str, Any]:
        t, g = self.cfg.train, self.cfg.grpo
        return {"experiment_id": self.cfg.run.name or self.out.name, "stage": "grpo", "method": "full",
                "config": to_dict(self.cfg), "data_hash": self.data_hash, "num_tasks": len(self.tasks),
                "tokenizer_hash": tokenizer_hash(self.cfg.model.init), "tokenizer_dir": self.cfg.model.init,
                "model_init": self.cfg.model.init, "model_init_hash": model_hash(self.cfg.model.init),
                "lr": t.lr, "seed": t.seed, "device": str(self.device), "dtype": "float32",
                "samples_per_step": g.prompts_per_step * g.group_size, "rollout_engine": "lmforge.engine.LLM",
                "model_config": self.model.config.to_hf(dtype="float32"),
                "num_parameters": self.model.num_parameters()}

    def _finish(self) -> dict[str, Any]:
        rows = [m for m in read_metrics(self.out) if "reward_mean" in m]
        k = max(1, min(5, len(rows) // 4))  # first and last few steps: sampled accuracy is noisy per step
        first, last = rows[:k], rows[-k:]
        results = {"steps": self.progress.step, "rollout_tokens": self.progress.rollout_tokens,
                   "train_time_s": round(self.progress.train_time, 3),
                   **{f"{name}_{end}": float(np.mean([m[key] for m in part])) if rows else None
                      for name, key in (("accuracy", "accuracy"), ("format_rate", "format_rate"),
                                        ("response_len", "response_len_mean"), ("reward", "reward_mean"))
                      for end, part in (("first", first), ("last", last))},
                   "averaged_over_steps": k,
                   "rollout_s": round(sum(m["rollout_s"] for m in rows), 3),
                   "update_s": round(sum(m["update_s"] for m in rows), 3),
                   "sync_s": round(sum(m["sync_s"] for m in rows), 3),
                   "peak_mem": peak_memory()["cpu_max_rss_bytes"],
                   "last_checkpoint": str(self.checkpointer.last) if self.checkpointer.last else None}
        try:
            results["reward_curve"] = str(plot_rewards(self.out))
        except Exception as e:  # a missing plot must not fail a finished run
            print(f"warning: reward curve not drawn: {e}")
        self.run.finish(**results)
        return self.run.read_record()


def plot_rewards(run: str | Path, out: str | Path | None = None) -> Path:
    """RUN/reward.png: reward mean, accuracy and format rate of the rollouts per step."""
    plt = _pyplot()
    rows = [m for m in read_metrics(run) if "reward_mean" in m]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    steps = [m["step"] for m in rows]
    for key, label in (("reward_mean", "reward (mean)"), ("accuracy", "accuracy"), ("format_rate", "format rate")):
        ax.plot(steps, [m[key] for m in rows], lw=1.5, label=label)
    ax.set_xlabel("GRPO step")
    ax.set_title(f"{Path(run).name}: rollouts per step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out or Path(run) / "reward.png")
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(out)
    return out


def _format_row(row: dict[str, Any], max_steps: int) -> str:
    return (f"grpo step {row['step']}/{max_steps} | reward {row['reward_mean']:.3f} | acc {row['accuracy']:.3f} | "
            f"format {row['format_rate']:.3f} | len {row['response_len_mean']:.0f} | clip {row['clip_frac']:.3f} | "
            f"rollout {row['rollout_s']:.1f}s ({row['rollout_tokens_per_s']:,.0f} tok/s) | "
            f"update {row['update_s']:.1f}s")


def train_grpo(cfg: TrainConfig, out: str | Path, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Run the GRPO stage into `out`; returns the final record."""
    trainer = GRPOTrainer(cfg, Path(out), resume=resume, overwrite=overwrite)
    try:
        return trainer.fit()
    except BaseException as e:
        trainer.run.write_record({"status": "failed", "error": f"{type(e).__name__}: {e}",
                                  "last_checkpoint": str(trainer.checkpointer.last) if trainer.checkpointer.last
                                  else None})
        raise
