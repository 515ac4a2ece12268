"""The GRPO objective: group-relative advantages, the clipped policy ratio, the KL estimator.

For task q with G samples o_1..o_G and rewards r_i (DeepSeekMath, Shao et al. 2024, eq. 3):

    A_i      = (r_i - mean(r)) / (std(r) + eps)         (std scaling optional: Dr. GRPO drops it)
    rho_it   = pi_theta(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t)
    L_it     = -min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i) + beta KL_it
    KL_it    = exp(ref_it - logp_it) - (ref_it - logp_it) - 1     (Schulman's k3: unbiased, >= 0)

aggregated over tokens: `token` = sum over every completion token of the batch / their number
(DAPO; long answers weigh by their length), `sequence` = mean over samples of each sample's token
mean (the GRPO paper), `dr_grpo` = sum over every completion token / (samples x max_tokens), a constant
that depends on neither the lengths nor the batch (Dr. GRPO, Liu et al. 2025; TRL's
`loss_type="dr_grpo"`): no sample's tokens are weighed up for being short. std is torch's (unbiased, as TRL computes it). pi_old is the policy that
sampled the rollouts: its log-probabilities come from the engine, so on the first pass rho = 1.

Pure tensor functions; they know nothing about models, engines or configs.

Shape legend: N samples (tasks x group), G group size, T completion positions.
"""

from __future__ import annotations

import torch


def group_advantages(rewards_N: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """A_i relative to its own group (consecutive runs of `group_size` samples)."""
    r_QG = rewards_N.view(-1, group_size)
    adv_QG = r_QG - r_QG.mean(dim=1, keepdim=True)
    if scale:
        adv_QG = adv_QG / (r_QG.std(dim=1, keepdim=True) + eps)
    return adv_QG.reshape(-1)


def kl_k3(logp_NT: torch.Tensor, ref_logp_NT: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate exp(d) - d - 1 with d = ref - logp."""
    d = ref_logp_NT - logp_NT
    return torch.exp(d) - d - 1


def grpo_loss(logp_NT: torch.Tensor, old_logp_NT: torch.Tensor, adv_N: torch.Tensor, mask_NT: torch.Tensor,
              clip_low: float, clip_high: float, beta: float = 0.0, ref_logp_NT: torch.Tensor | None = None,
              agg: str = "token", num_tokens: float | None = None, num_seqs: float | None = None,
              max_len: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one minibatch and its per-token statistics (sums over masked tokens, detached).

    `num_tokens` / `num_seqs`: the denominators of the whole batch, so minibatches of one step add up
    to the loss of the step (default: this minibatch's own). `max_len`: dr_grpo's constant length (the
    rollouts' max_tokens)."""
    mask = mask_NT.to(logp_NT.dtype)
    ratio_NT = torch.exp(logp_NT - old_logp_NT)
    adv_N1 = adv_N[:, None]
    unclipped = ratio_NT * adv_N1
    clipped = torch.clamp(ratio_NT, 1 - clip_low, 1 + clip_high) * adv_N1
    per_token = -torch.minimum(unclipped, clipped)
    kl_NT = None
    if beta > 0:
        if ref_logp_NT is None:
            raise ValueError("beta > 0 needs the reference model's log-probabilities")
        kl_NT = kl_k3(logp_NT, ref_logp_NT)
        per_token = per_token + beta * kl_NT
    if agg == "token":
        loss = (per_token * mask).sum() / (num_tokens if num_tokens is not None else mask.sum().clamp(min=1))
    elif agg == "sequence":
        per_seq = (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        loss = per_seq.sum() / (num_seqs if num_seqs is not None else per_seq.numel())
    elif agg == "dr_grpo":
        if not max_len:
            raise ValueError("loss_agg 'dr_grpo' needs max_len (the rollouts' max_tokens)")
        loss = (per_token * mask).sum() / ((num_seqs if num_seqs is not None else mask.shape[0]) * max_len)
    else:
        raise ValueError(f"loss_agg must be 'token', 'sequence' or 'dr_grpo', got {agg!r}")
    with torch.no_grad():
        is_clipped = ((ratio_NT < 1 - clip_low) & (adv_N1 < 0)) | ((ratio_NT > 1 + clip_high) & (adv_N1 > 0))
        stats = {"tokens": mask.sum(), "clipped": (is_clipped * mask).sum(), "ratio": (ratio_NT * mask).sum(),
                 "kl": (kl_NT * mask).sum() if kl_NT is not None else torch.zeros(())}
    return loss, stats


def completion_logprobs(logits_NTV: torch.Tensor, targets_NT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and the entropy of each position's distribution, both (N, T), float32."""
    logp_NTV = torch.log_softmax(logits_NTV.float(), dim=-1)
    logp_NT = logp_NTV.gather(-1, targets_NT.unsqueeze(-1)).squeeze(-1)
    entropy_NT = -(logp_NTV.exp() * logp_NTV).sum(-1)
    return logp_NT, entropy_NT
