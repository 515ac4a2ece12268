"""The `grpo` section of the training config (used when `train.stage=grpo`).

GRPO also reads the shared sections: `model.init` (the HF folder the policy starts from and the
engine loads), `data.path` (a task JSONL: prompt/answer or GSM8K's question/`#### N`) and `train`
(lr and its schedule, max_steps = policy updates' outer steps, grad_clip, seed, ckpt_every,
keep_last, log_every, dtype). Knows nothing about tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lmforge.config import ConfigError


@dataclass
class GRPOSection:
    prompts_per_step: int = 8  # distinct tasks per step
    group_size: int = 8  # samples per task; advantages are relative to the group
    max_tokens: int = 256  # new tokens per sample
    temperature: float = 1.0
    top_p: float = 1.0
    epochs: int = 1  # passes over the same rollouts (PPO epochs); > 1 makes the clip matter
    minibatches: int = 1  # optimizer steps per epoch (rollouts split evenly)
    clip_eps: float = 0.2  # ratio clipped to [1 - clip_eps, 1 + clip_eps_high]
    clip_eps_high: float | None = None  # None = clip_eps (DAPO's clip-higher when larger)
    beta: float = 0.0  # KL to the frozen reference (k3 estimator); 0 = no reference model at all
    scale_rewards: bool = True  # divide advantages by the group's reward std (Dr. GRPO: false)
    loss_agg: Literal["token", "sequence", "dr_grpo"] = "token"  # token: mean over all tokens (DAPO); sequence:
    # GRPO paper; dr_grpo: token sum / (samples x max_tokens) (Dr. GRPO)
    rewards: list[str] = field(default_factory=lambda: ["format", "correct"])  # built-ins or module:function
    reward_weights: list[float] = field(default_factory=lambda: [1.0, 1.0])
    think_open: str = "<think>"
    think_close: str = "</think>"
    answer_prefix: str = "Answer:"

    def validate(self) -> None:
        for key in ("prompts_per_step", "group_size", "max_tokens", "epochs", "minibatches"):
            if getattr(self, key) < 1:
                raise ConfigError(f"grpo.{key} must be >= 1, got {getattr(self, key)}")
        if self.group_size < 2:
            raise ConfigError(f"grpo.group_size must be >= 2 (advantages compare samples within a group), "
                              f"got {self.group_size}")
        if (self.prompts_per_step * self.group_size) % self.minibatches:
            raise ConfigError(f"grpo.minibatches={self.minibatches} must divide prompts_per_step x group_size = "
                              f"{self.prompts_per_step * self.group_size}")
        if not 0 < self.clip_eps < 1 or (self.clip_eps_high is not None and self.clip_eps_high <= 0):
            raise ConfigError("grpo.clip_eps must be in (0, 1) and grpo.clip_eps_high > 0")
        if self.beta < 0 or self.temperature <= 0 or not 0 < self.top_p <= 1:
            raise ConfigError("grpo.beta must be >= 0, grpo.temperature > 0, grpo.top_p in (0, 1]")
        if not self.rewards or len(self.rewards) != len(self.reward_weights):
            raise ConfigError(f"grpo.rewards ({self.rewards}) and grpo.reward_weights ({self.reward_weights}) "
                              f"must be non-empty and of the same length")
