"""The DPO stage: push the policy's log-likelihood ratio of chosen over rejected completions above the
reference model's, from preference pairs (`pref_data.py`; `lmforge flywheel build` writes them).

Loss (Rafailov et al. 2023, eq. 7), per pair, with log-probs summed over the completion's tokens only:

    chosen_logratio   = log pi(y_w | x) - log ref(y_w | x)
    rejected_logratio = log pi(y_l | x) - log ref(y_l | x)
    sigmoid   -log sigmoid(beta * (chosen_logratio - rejected_logratio))
    ipo       (chosen_logratio / |y_w| - rejected_logratio / |y_l| - 1 / (2 beta))^2   (Azar et al. 2023;
              per-token averages, as TRL computes it)
    + rpo_alpha * (-log pi(y_w | x) / |y_w|)   with `dpo.rpo_alpha` > 0: the chosen completion's negative
              log-likelihood per token (RPO, Pang et al. 2024; TRL's `rpo_alpha`). When chosen and rejected differ
              in a token or two (a digit of an answer), the sigmoid loss alone can lower both, the chosen one
              included ("likelihood displacement", Razin et al. 2024); the NLL term holds the chosen one up

and the step's loss is the mean over its pairs (all micro-batches and ranks). What is logged is what TRL's
`DPOTrainer` logs: rewards/chosen = beta * chosen_logratio (mean), rewards/rejected, rewards/margins,
rewards/accuracies (share of pairs with chosen reward > rejected reward), logps/chosen, logps/rejected.
The reference is the starting model, frozen: for LoRA the same model with its adapters switched off (no
second copy; what TRL does with a peft model), for full fine-tuning a second copy loaded from `model.init`,
or, with `dpo.precompute_ref_log_probs`, neither: every pair's reference log-probs are computed once before
step 1 (TRL's `precompute_ref_log_probs`) and the copy is dropped. Both give the same numbers.

`DPOTrainer` is `loop.Trainer` with another loss: the same model building (full or LoRA, light or quantized
base), optimizer, schedule, DDP, checkpoints and exact resume (the preference loader's position is in the
checkpoint; the reference is the starting model, so it is rebuilt, never saved), record and export.
`lmforge bench`-style parity with TRL 1.16 lives in `scripts/bench_trl_dpo.py` (tests/dpo_trl_reference.json).

    lmforge train configs/dpo.yaml model.init=models/sft data.path=runs/flywheel/preferences.jsonl --out runs/dpo

Shape legend: B pairs, R = 2B rows (chosen rows first), L tokens per row, V vocabulary.
"""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lmforge.config import ConfigError
from lmforge.eval.backends import model_hash
from lmforge.quant import load_pretrained
from lmforge.tokenizer.load import load_tokenizer, tokenizer_hash

from .config import TrainConfig
from .fused_ce import CHUNK_TOKENS, can_fuse
from .loop import Data, Trainer, fit_then_leave, token_byte_lengths
from .lora import adapters_disabled, is_lora
from .pref_data import PreferenceLoader

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


def token_logps(logits_RLV: torch.Tensor, targets_RL: torch.Tensor) -> torch.Tensor:
    """log p(target) at each position (R, L), the softmax in float32."""
    return torch.gather(logits_RLV.float().log_softmax(-1), 2, targets_RL.unsqueeze(-1)).squeeze(-1)


def _head_logps(h_RLD: torch.Tensor, w_VD: torch.Tensor, targets_RL: torch.Tensor) -> torch.Tensor:
    return token_logps(F.linear(h_RLD, w_VD), targets_RL)  # under autocast the matmul runs as nn.Linear's would


class PreferenceLogps(torch.nn.Module):
    """`forward(input_ids, completion_mask)` = (summed log-prob of each row's completion tokens (R,), their count
    (R,)); what DDP and compile wrap. With a plain LM head (`fused_ce.can_fuse`) the logits are made a block of
    rows at a time (~`BLOCK_TOKENS` tokens) under activation checkpointing and recomputed in backward, so the
    (R, L, V) logits and log-softmax never exist whole (TRL fuses its LM head for the same reason); otherwise
    (a LoRA-adapted head) through the model's own forward."""

    BLOCK_TOKENS = CHUNK_TOKENS  # as the fused SFT loss's chunks (the pre-flight counts one block of logits)

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model, self.blocked = model, can_fuse(model)

    def forward(self, input_ids: torch.Tensor, completion_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask_RL = completion_mask[:, 1:].bool()  # logits at t predict token t + 1
        targets_RL = input_ids[:, 1:]
        if not self.blocked:
            logp_RL = token_logps(self.model(input_ids)[:, :-1], targets_RL)
        else:
            h_RLD, w_VD = self.model.hidden_states(input_ids)[:, :-1], self.model.lm_head.weight
            rows = max(1, self.BLOCK_TOKENS // max(h_RLD.shape[1], 1))
            logp_RL = torch.cat([checkpoint(_head_logps, h_RLD[i:i + rows], w_VD, targets_RL[i:i + rows],
                                            use_reentrant=False) for i in range(0, len(h_RLD), rows)])
        return (logp_RL * mask_RL).sum(-1), mask_RL.sum(-1)


def sequence_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """`PreferenceLogps` of a model (or of an already wrapped one) on a batch."""
    fwd = model if isinstance(model, PreferenceLogps) else PreferenceLogps(model)
    return fwd(batch["input_ids"], batch["completion_mask"])


def dpo_loss(logps: torch.Tensor, ref_logps: torch.Tensor, lengths: torch.Tensor, beta: float,
             loss_type: str = "sigmoid", rpo_alpha: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair losses (B,) and per-pair statistics, from rows laid out [chosen; rejected] (R = 2B)."""
    chosen, rejected = logps.chunk(2)
    ref_chosen, ref_rejected = ref_logps.chunk(2)
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    n_chosen, n_rejected = lengths.chunk(2)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    elif loss_type == "ipo":
        delta = chosen_ratio / n_chosen.clamp(min=1) - rejected_ratio / n_rejected.clamp(min=1)
        losses = (delta - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r} (sigmoid or ipo)")
    if rpo_alpha:
        losses = losses + rpo_alpha * (-chosen / n_chosen.clamp(min=1))
    chosen_rewards, rejected_rewards = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    stats = {"rewards/chosen": chosen_rewards, "rewards/rejected": rejected_rewards,
             "rewards/margins": chosen_rewards - rejected_rewards,
             "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
             "logps/chosen": chosen.detach(), "logps/rejected": rejected.detach()}
    return losses, stats


class DPOTrainer(Trainer):
    def __init__(self, cfg: TrainConfig, out: Path, resume: bool = False, overwrite: bool = False):
        super().__init__(cfg, out, resume=resume, overwrite=overwrite)
        self.dpo = cfg.dpo
        # the reference: the starting weights, never trained (rebuilt, not restored, on --resume)
        self.ref_model = None if is_lora(self.raw_model) else self._load_reference()
        self.ref_cache: dict[str, torch.Tensor] = {}
        if self.dpo.precompute_ref_log_probs:
            self.ref_cache["train"] = self._precompute(self.data.train)
            if self.val_loader is not None:
                self.ref_cache["val"] = self._precompute(self.val_loader)
            self.ref_model = None  # TRL drops it too: no second model during training

    def forward_module(self) -> torch.nn.Module:
        return PreferenceLogps(self.model)  # each row's completion log-prob, not a summed cross-entropy

    def make_data(self) -> Data:
        cfg, t = self.cfg, self.cfg.train
        tok_dir = cfg.data.tokenizer or cfg.model.init
        tok = load_tokenizer(tok_dir)

        def loader(path: str, seed: int) -> PreferenceLoader:
            return PreferenceLoader(path, tok, max_length=t.seq_len, batch_size=t.batch_size, seed=seed,
                                    rank=self.d.rank, world_size=self.d.world_size, device=str(self.device))

        train = loader(cfg.data.path, t.seed)
        val = loader(cfg.data.val_path, 0) if cfg.data.val_path else None
        notes = [] if val else ["no data.val_path: no evaluation"]
        if train.stats.prompt_diverged:
            notes.append(f"{cfg.data.path}: in {train.stats.prompt_diverged} pair(s) the tokenized prompt is not a "
                         "prefix of prompt + completion (the chat template renders it differently); the completion "
                         "starts where they differ, as in TRL")
        self.val_loader = val
        return Data(train, (lambda: val) if val else None, t.seq_len, len(tok), train.data_hash,
                    tokenizer_hash(tok_dir), tok_dir, token_byte_lengths(tok_dir), notes)

    def _load_reference(self) -> torch.nn.Module:
        ref = load_pretrained(self.cfg.model.init, dtype="float32", device="cpu")
        return ref.to(self.device).eval().requires_grad_(False)

    @contextlib.contextmanager
    def _reference(self):
        """The module that computes reference log-probs: the frozen copy, or the policy without adapters."""
        if self.ref_model is not None:
            yield self.ref_model
            return
        was_training = self.model.training
        self.model.eval()
        try:
            with adapters_disabled(self.model):
                yield self.model
        finally:
            self.model.train(was_training)

    @torch.no_grad()
    def ref_logps(self, batch: dict[str, torch.Tensor], split: str = "train") -> torch.Tensor:
        """Reference log-probs of the batch's rows (R,): from the precomputed table or a forward pass."""
        if split in self.ref_cache:
            table_N2 = self.ref_cache[split]
            return torch.cat([table_N2[batch["index"], 0], table_N2[batch["index"], 1]]).to(self.device)
        with self._reference() as ref, self.autocast():
            return sequence_logps(ref, batch)[0]

    def _precompute(self, loader: PreferenceLoader) -> torch.Tensor:
        """(pairs, 2) reference log-probs [chosen, rejected] of every pair, in file order, batch_size at a time."""
        n, size = len(loader.pairs), loader.batch_size
        table_N2 = torch.zeros(n, 2)
        for lo in range(0, n, size):
            idx = list(range(lo, min(lo + size, n)))
            logps = self.ref_logps(loader.batch_of(idx), split="none").cpu()
            table_N2[idx, 0], table_N2[idx, 1] = logps.chunk(2)
        return table_N2

    def forward_backward(self, batches: list[dict[str, torch.Tensor]]) -> tuple[float, dict[str, Any]]:
        """Mean DPO loss over the step's pairs (all micro-batches, all ranks); backward of it; TRL's metrics."""
        (n_pairs,) = self.d.all_sum(sum(len(b["index"]) for b in batches))
        total, sums = 0.0, dict.fromkeys(METRICS, 0.0)
        for i, batch in enumerate(batches):
            ref = self.ref_logps(batch)
            with self.sync_context(i == len(batches) - 1):
                with self.autocast():
                    logps, lengths = self.fwd(batch["input_ids"], batch["completion_mask"])
                losses, stats = dpo_loss(logps, ref, lengths, self.dpo.beta, self.dpo.loss_type, self.dpo.rpo_alpha)
                # DDP averages gradients over ranks; scaling by world_size makes that a global pair mean
                self.scaler.scale(losses.sum() * (self.d.world_size / n_pairs)).backward()
            total += float(losses.detach().sum())
            for k in METRICS:
                sums[k] += float(stats[k].sum())
        reduced = self.d.all_sum(total, *sums.values())
        return reduced[0] / n_pairs, {k: v / n_pairs for k, v in zip(METRICS, reduced[1:])}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float] | None:
        """DPO loss and reward statistics over `eval_batches` batches of data.val_path (from its start)."""
        if self.val_loader is None:
            return None
        self.model.eval()
        loader = self.val_loader
        loader.epoch, loader.step = 0, 0
        n_batches = min(max(1, self.cfg.train.eval_batches), loader.steps_per_epoch)
        total, n, sums = 0.0, 0, dict.fromkeys(METRICS, 0.0)
        for batch in itertools.islice(loader, n_batches):
            with self.autocast():
                logps, lengths = sequence_logps(self.model, batch)
            losses, stats = dpo_loss(logps, self.ref_logps(batch, "val"), lengths, self.dpo.beta, self.dpo.loss_type,
                                     self.dpo.rpo_alpha)
            total, n = total + float(losses.sum()), n + len(losses)
            for k in METRICS:
                sums[k] += float(stats[k].sum())
        self.model.train()
        total, n, *rest = self.d.all_sum(total, n, *sums.values())
        return {"val_loss": total / n, **{f"val_{k}": v / n for k, v in zip(METRICS, rest)}}

    def _static_record(self) -> dict[str, Any]:
        rec = super()._static_record()
        rec["dpo"] = {"beta": self.dpo.beta, "loss_type": self.dpo.loss_type, "rpo_alpha": self.dpo.rpo_alpha,
                      "reference": ("precomputed" if self.dpo.precompute_ref_log_probs else
                                    "adapters disabled" if self.ref_model is None else "frozen copy of model.init"),
                      "pairs": self.data.train.stats.as_dict(), "pairs_per_step": rec["effective_batch"]}
        rec["model_init"], rec["model_init_hash"] = self.cfg.model.init, model_hash(self.cfg.model.init)
        return rec


def train_dpo(cfg: TrainConfig, out: str | Path, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Run the DPO stage into `out`; returns the final record."""
    if cfg.train.stage != "dpo":
        raise ConfigError(f"train_dpo needs train.stage=dpo, got {cfg.train.stage}")
    return fit_then_leave(lambda: DPOTrainer(cfg, Path(out), resume=resume, overwrite=overwrite))
