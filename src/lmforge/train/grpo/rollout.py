"""Rollouts for GRPO through lmforge's own engine, in the trainer's process.

`RolloutEngine` holds one `lmforge.engine.LLM` over the policy's starting folder (float32, the
model's own modules, so `LLM.load_weights` can follow the trainer every step). `generate` renders
each task's prompt with the chat template (the user turn + `<|im_start|>assistant\\n`, exactly what
SFT trained and eval prompts with), asks for `group_size` samples per task with the sampled
token's log-probability (`logprobs=0`), and returns them grouped: sample j of task i is row
i * G + j. Each task's sampling is seeded by (seed, step, task position), so a resumed run draws
the same rollouts as one that never stopped.

The log-probabilities are of the raw policy (the logits before temperature / top-p, as vLLM
returns them): with temperature 1 and top-p 1 they are exactly pi_old of the samples.

It knows nothing about rewards, losses or optimizers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from lmforge.engine import LLM, SamplingParams


@dataclass
class Rollout:
    task_index: int  # position of the task in this step's batch
    prompt_ids: list[int]
    completion_ids: list[int]  # generated tokens, the stop token (<|im_end|>) included when it was sampled
    logprobs: list[float]  # engine's log p of each completion token
    text: str
    finish_reason: str | None


def chat_prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """The user turn rendered by the model's chat template, with the generation prompt; no BOS."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


class RolloutEngine:
    def __init__(self, model_dir: str, device: str, group_size: int, max_tokens: int, temperature: float,
                 top_p: float, seed: int, max_num_seqs: int = 256):
        self.llm = LLM(model_dir, dtype="float32", device=device, pack_weights=False,
                       max_num_seqs=max_num_seqs, seed=seed)
        self.tokenizer = self.llm.get_tokenizer()
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{model_dir}: GRPO needs a tokenizer with a chat template (export the SFT run "
                             f"with `lmforge export`, which copies it)")
        self.group_size, self.max_tokens, self.temperature, self.top_p = group_size, max_tokens, temperature, top_p
        self.seed = seed

    def load_weights(self, model: torch.nn.Module) -> float:
        """Give the engine the trainer's current weights; returns the seconds it took."""
        t0 = time.perf_counter()
        self.llm.load_weights(model.state_dict())
        return time.perf_counter() - t0

    def generate(self, prompts: list[str], step: int) -> list[Rollout]:
        ids = [chat_prompt_ids(self.tokenizer, p) for p in prompts]
        params = [SamplingParams(n=self.group_size, temperature=self.temperature, top_p=self.top_p,
                                 max_tokens=self.max_tokens, logprobs=0,
                                 seed=(self.seed * 1_000_003 + step) * 4096 + i) for i in range(len(prompts))]
        outputs = self.llm.generate(ids, params, use_tqdm=False)
        rollouts = []
        for i, out in enumerate(outputs):
            for c in out.outputs:
                lps = [lp[tok] for tok, lp in zip(c.token_ids, c.logprobs)]
                rollouts.append(Rollout(i, list(out.prompt_token_ids), list(c.token_ids), lps, c.text,
                                        c.finish_reason))
        return rollouts
