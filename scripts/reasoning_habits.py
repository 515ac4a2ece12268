"""Which habit a reasoning model follows, and how often each is right (docs/reasoning.md, fourth round).

For each MODEL (an exported SFT or GRPO run), the arith-cot items of the given categories are answered
greedily and with `--samples` draws at temperature 1 through lmforge's engine; every answer is sorted by
its think block: `steps` (worked out), `direct` (an empty think block: the answer alone) or `none` (no
closed think block), and scored with the one extractor GRPO's reward and eval use. Prints and writes
(`--out`) the share and accuracy of each habit, per category and in all.

    python scripts/reasoning_habits.py runs/quickstart/reasoning/sft/model runs/quickstart/reasoning/grpo/model
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Annotated, Optional

import typer

from lmforge.engine import LLM, SamplingParams
from lmforge.quickstart import GRPO_CATEGORIES
from lmforge.tasks.reasoning import DEFAULT_FORMAT, answers_match, extract_answer
from lmforge.tasks.suite import load_suite
from lmforge.train.grpo.rollout import chat_prompt_ids


def measure(model: str, categories: list[str], samples: int, max_tokens: int, seed: int) -> dict:
    items = [it for it in load_suite("arith-cot").items if it["category"] in categories]
    llm = LLM(model, dtype="float32", seed=seed, enable_prefix_caching=False)
    ids = [chat_prompt_ids(llm.get_tokenizer(), it["prompt"]) for it in items]
    result = {}
    for mode, params in (("greedy", [SamplingParams(temperature=0.0, max_tokens=max_tokens)] * len(ids)),
                         ("temperature_1", [SamplingParams(n=samples, temperature=1.0, max_tokens=max_tokens,
                                                           seed=1000 * (seed + 1) + i) for i in range(len(ids))])):
        counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # answers, right
        for it, out in zip(items, llm.generate(ids, params, use_tqdm=False)):
            for c in out.outputs:
                right, habit = answers_match(extract_answer(c.text), it["answer"]), DEFAULT_FORMAT.habit(c.text)
                for key in ("all", f"all/{habit}", it["category"], f"{it['category']}/{habit}"):
                    counts[key][0] += 1
                    counts[key][1] += right
        total = counts["all"][0]
        result[mode] = {k: {"answers": n, "share": n / total if "/" in k else None, "accuracy": r / n}
                        for k, (n, r) in sorted(counts.items())}
    return {"model": model, "items": len(items), "categories": categories, "samples": samples, "result": result}


def main(models: list[str],
         categories: Annotated[str, typer.Option(help="Comma-separated arith-cot categories.")] = ",".join(GRPO_CATEGORIES),
         samples: Annotated[int, typer.Option(help="Draws per item at temperature 1.")] = 16,
         max_tokens: int = 160, seed: int = 0,
         out: Annotated[Optional[Path], typer.Option(help="Write reasoning_habits.json here.")] = None) -> None:
    reports = [measure(m, categories.split(","), samples, max_tokens, seed) for m in models]
    for rep in reports:
        print(rep["model"])
        for mode, rows in rep["result"].items():
            parts = [f"{k} {v['accuracy']:.1%}" + (f" ({v['share']:.0%} of answers)" if v["share"] is not None else "")
                     for k, v in rows.items() if k.startswith("all")]
            print(f"  {mode}: " + ", ".join(parts))
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "reasoning_habits.json").write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    typer.run(main)
