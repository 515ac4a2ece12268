"""One GRPO step of TRL's `GRPOTrainer`, timed with its split between rollout and update: the baseline
`lmforge bench grpo --trl-python PY` runs against lmforge's own GRPO step.

It runs in its own environment (`make trl-env`: `.venv-trl`, TRL and its extra dependencies on top of
lmforge's locked packages), because TRL is a benchmark baseline, not a dependency of lmforge. The same
model folder, the same prompts (chat template), the same group size, `max_completion_length`,
temperature 1, beta 0 (no reference model), one pass (`num_iterations=1`), token-level loss (`dapo`,
lmforge's `loss_agg: token`), rewards `format` + `correct` from lmforge's own reward functions,
float32 on CPU, no vLLM (TRL then generates with `transformers.generate` on the whole batch).

Rollout time is the time inside `GRPOTrainer._generate_and_score_completions` (generation, decoding,
rewards, advantages); update is the rest of the step (forward + backward + optimizer). Writes one JSON
object to --out.

    .venv-trl/bin/python scripts/bench_trl_grpo.py --model M --tasks T --out trl.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tasks", required=True)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import datasets
    import torch
    import transformers
    import trl

    from lmforge.data.synth import read_tasks
    from lmforge.train.grpo.reward import correct_reward, format_reward

    tasks = read_tasks(a.tasks)[:a.prompts]
    by_prompt = {t["prompt"]: t for t in tasks}
    ds = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": t["prompt"]}], "question": t["prompt"]}
                                     for t in tasks] * a.steps)

    def _texts(completions) -> list[str]:
        return [c[0]["content"] if isinstance(c, list) else c for c in completions]

    def format_fn(completions, question, **_) -> list[float]:
        return [format_reward(c, by_prompt[q]) for c, q in zip(_texts(completions), question)]

    def correct_fn(completions, question, **_) -> list[float]:
        return [correct_reward(c, by_prompt[q]) for c, q in zip(_texts(completions), question)]

    samples = a.prompts * a.group_size
    out_dir = Path(a.out).with_suffix(".trainer")
    cfg = trl.GRPOConfig(
        output_dir=str(out_dir), max_steps=a.steps, learning_rate=a.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, per_device_train_batch_size=samples,
        gradient_accumulation_steps=1, generation_batch_size=samples, num_generations=a.group_size,
        max_completion_length=a.max_tokens, temperature=1.0, top_p=1.0, beta=0.0, num_iterations=1,
        loss_type="dapo", use_cpu=True, bf16=False, fp16=False, report_to=[], logging_steps=1,
        save_strategy="no", seed=a.seed, disable_tqdm=True, dataloader_num_workers=0, shuffle_dataset=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(a.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[format_fn, correct_fn], args=cfg, train_dataset=ds,
                              processing_class=tok)

    def timed(name: str, seconds: list[float]) -> list:
        """Wrap the trainer's method `name` so each call's wall time lands in `seconds`; returns its results."""
        inner, results = getattr(trainer, name), []

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            r = inner(*args, **kwargs)
            seconds.append(time.perf_counter() - t0)
            results.append(r)
            return r

        setattr(trainer, name, wrapper)
        return results

    rollout_s: list[float] = []
    step_s: list[float] = []
    rollouts = timed("_generate_and_score_completions", rollout_s)
    timed("training_step", step_s)
    trainer.train()
    completion_tokens = [int(r["completion_mask"].sum()) for r in rollouts]
    last = len(step_s) - 1  # the first step carries one-time costs (allocations, kernel selection)
    result = {"system": f"TRL {trl.__version__} GRPOTrainer (transformers {transformers.__version__} generate, "
                        f"no vLLM)", "steps": len(step_s), "step_s": step_s, "rollout_s": rollout_s,
              "update_s": [s - r for s, r in zip(step_s, rollout_s)], "completion_tokens": completion_tokens,
              "last_step_s": step_s[last], "last_rollout_s": rollout_s[last],
              "last_update_s": step_s[last] - rollout_s[last], "last_completion_tokens": completion_tokens[last],
              "samples_per_step": samples, "threads": torch.get_num_threads(), "load": list(os.getloadavg())}
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
