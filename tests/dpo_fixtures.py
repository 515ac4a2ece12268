"""A tiny DPO setup shared by tests/test_train_dpo.py and scripts/dpo_trl_parity.py: the reasoning fixtures'
tasks, tokenizer and random Llama, and preference pairs over those tasks in TRL's two explicit-prompt
formats, where "chosen" gives the right answer in the reasoning format and "rejected" a wrong one.
Everything is a function of fixed seeds, so the parity script and the test build the same bytes (the
fixture records their hashes)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from reasoning_fixtures import tiny_model, write_tasks

from lmforge.model import Transformer
from lmforge.tasks.reasoning import DEFAULT_FORMAT


def write_pairs(path: Path, tasks: Path, conversational: bool = True, n: int = 16) -> Path:
    rows = [json.loads(x) for x in tasks.read_text().splitlines()][:n]
    out = []
    for i, r in enumerate(rows):
        chosen = DEFAULT_FORMAT.render(r["reasoning"], r["answer"])
        rejected = DEFAULT_FORMAT.render(r["reasoning"], str(int(r["answer"]) + 1 + i % 3))
        if conversational:
            out.append({"id": f"p{i}", "prompt": [{"role": "user", "content": r["prompt"]}],
                        "chosen": [{"role": "assistant", "content": chosen}],
                        "rejected": [{"role": "assistant", "content": rejected}]})
        else:
            out.append({"id": f"p{i}", "prompt": f"Question: {r['prompt']}\n", "chosen": chosen, "rejected": rejected})
    path.write_text("".join(json.dumps(o) + "\n" for o in out))
    return path


def build(root: Path) -> dict[str, Path]:
    """Under root: model (HF folder with tokenizer and chat template), ref (the same shape and tokenizer, other
    random weights: a reference the policy differs from, so the loss is not log 2), conversational.jsonl,
    standard.jsonl."""
    root.mkdir(parents=True, exist_ok=True)
    tasks = write_tasks(root / "tasks.jsonl", n=32, seed=11)
    model = tiny_model(root, tasks, hidden=32, layers=2, seed=3)
    ref = root / "ref"
    Transformer.from_pretrained(model, dtype="float32").init_weights(4).save_pretrained(ref)
    for f in model.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation")):
            shutil.copyfile(f, ref / f.name)
    return {"model": model, "ref": ref, "conversational": write_pairs(root / "conversational.jsonl", tasks, True),
            "standard": write_pairs(root / "standard.jsonl", tasks, False)}
