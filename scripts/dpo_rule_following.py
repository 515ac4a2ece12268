"""Can preference data teach a rule? DPO (LoRA) on synthetic pairs whose chosen answer follows a rule
the base model breaks, and the rule-following rate of greedy answers to held-out prompts before and after:

    python scripts/dpo_rule_following.py --out runs/dpo-rule [--model DIR] [--pairs 256] [--eval 200] [--steps 60]

The rule: the answer opens with the marker `Sure!`. Each pair is one user prompt with the same answer body
twice, chosen = "Sure! " + body, rejected = body, in TRL's conversational preference format (what
`lmforge flywheel build` writes). Training runs `configs/dpo.yaml` (LoRA, sigmoid loss, beta 0.1) with
the overrides the record names; the held-out prompts share no topic word with the training prompts. The
rate is the share of held-out prompts whose greedy answer (lmforge's engine, the model's chat template,
16 new tokens) starts with the marker, with its binomial stderr sqrt(p (1 - p) / n).

Without `--model` it builds the tiny random Llama with a trained tokenizer that the tests use (hidden 64,
2 layers): a base that follows no rule. Writes rule_following.json and rule_following.md with the
command, the machine's load average, and the DPO run's reward metrics.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

from lmforge.config import load_config
from lmforge.engine import LLM, SamplingParams
from lmforge.track.io import atomic_write_json, atomic_write_text
from lmforge.track.short import shrink
from lmforge.train.config import TrainConfig
from lmforge.train.dpo import train_dpo
from lmforge.train.export import export_run

ROOT = Path(__file__).resolve().parents[1]
MARKER = "Sure!"
VERBS = ["Tell me about", "Describe", "What do you know about", "Explain", "Give a fact about", "Summarise"]
TRAIN_TOPICS = ["rivers", "lists", "tuples", "files", "clouds", "trains", "birds", "maps", "songs", "stones",
                "bridges", "clocks", "gardens", "ships", "lamps", "roads", "forests", "coins", "doors", "books",
                "islands", "towers", "engines", "letters", "mirrors", "ladders", "candles", "kettles", "rockets",
                "windows", "valleys", "markets", "bottles", "wheels", "planets", "shells", "tables", "ropes",
                "keys", "hills", "rings", "boats", "cables", "chairs", "drums", "fields", "gates"]
EVAL_TOPICS = ["deserts", "pianos", "glaciers", "lanterns", "volcanoes", "castles", "meadows", "harbours",
               "compasses", "orchards", "tunnels", "canyons", "fountains", "helmets", "anchors", "blankets",
               "comets", "statues", "carpets", "whistles", "puzzles", "barrels", "pebbles", "quilts", "saddles",
               "tents", "violins", "wagons", "zebras", "sockets", "jackets", "kites", "magnets", "needles"]
ADJ = ["useful", "old", "common", "simple", "large", "quiet", "bright", "heavy"]


def pairs(topics: list[str], n: int) -> list[dict]:
    out = []
    for i in range(n):
        topic, verb, adj = topics[i % len(topics)], VERBS[(i // len(topics)) % len(VERBS)], ADJ[i % len(ADJ)]
        body = f"{topic.capitalize()} are {adj}, and people use them every day."
        out.append({"prompt": [{"role": "user", "content": f"{verb} {topic}."}],
                    "chosen": [{"role": "assistant", "content": f"{MARKER} {body}"}],
                    "rejected": [{"role": "assistant", "content": body}]})
    return out


def eval_prompts(n: int) -> list[str]:
    return [f"{VERBS[(i // len(EVAL_TOPICS)) % len(VERBS)]} {EVAL_TOPICS[i % len(EVAL_TOPICS)]}." for i in range(n)]


def rule_rate(model: Path, prompts: list[str]) -> dict:
    """Greedy answers through the engine; the share that opens with the marker, with its stderr."""
    llm = LLM(str(model), dtype="float32", device="cpu")
    tok = llm.get_tokenizer()
    chats = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True) for p in prompts]
    outs = llm.generate(chats, SamplingParams(temperature=0.0, max_tokens=16))
    texts = [o.outputs[0].text for o in outs]
    hits = sum(t.lstrip().startswith(MARKER) for t in texts)
    p, n = hits / len(texts), len(texts)
    return {"n": n, "follows": hits, "rate": p, "stderr": math.sqrt(p * (1 - p) / n), "examples": texts[:3]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", type=Path, default=None, help="HF folder with a chat template (default: tiny random)")
    ap.add_argument("--pairs", type=int, default=256)
    ap.add_argument("--eval", type=int, default=200, help="held-out prompts scored")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--beta", type=float, default=0.1)
    args = ap.parse_args(argv)
    # LMFORGE_SHORT (CI): 16 pairs, 2 steps, 8 held-out prompts: the same run, not figures to quote
    args.pairs, args.eval, args.steps = shrink(args.pairs, 16), shrink(args.eval, 8), shrink(args.steps, 2)
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from lmforge.serve.testing import make_model_with_tokenizer  # deferred: only without --model

        tmp = Path(tempfile.mkdtemp(prefix="dpo-rule-"))
        model = make_model_with_tokenizer(tmp / "model", tmp / "tok")
    data = args.out / "preferences.jsonl"
    atomic_write_text(data, "".join(json.dumps(p) + "\n" for p in pairs(TRAIN_TOPICS, args.pairs)))
    prompts = eval_prompts(args.eval)
    t0 = time.perf_counter()
    before = rule_rate(model, prompts)
    overrides = [f"model.init={model}", f"data.path={data}", f"train.max_steps={args.steps}", f"train.lr={args.lr}",
                 "train.batch_size=8", "train.seq_len=64", f"train.warmup_steps={min(5, args.steps - 1)}", "train.eval_every=0",
                 "train.ckpt_every=0", "train.log_every=10", f"dpo.beta={args.beta}"]
    cfg = load_config(TrainConfig, ROOT / "configs" / "dpo.yaml", overrides)
    record = train_dpo(cfg, args.out / "run", overwrite=True)
    export_run(args.out / "run", args.out / "model")
    after = rule_rate(args.out / "model", prompts)
    metrics = [json.loads(line) for line in (args.out / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [m for m in metrics if "rewards/accuracies" in m][-1]
    result = {"rule": f"the answer opens with {MARKER!r}", "train_pairs": args.pairs, "overrides": overrides,
              "before": before, "after": after, "gain": after["rate"] - before["rate"],
              "z": (after["rate"] - before["rate"]) / (math.hypot(before["stderr"], after["stderr"]) or float("nan")),
              "dpo_last": {k: last.get(k) for k in ("step", "loss", "rewards/margins", "rewards/accuracies")},
              "train_time_s": (record.get("results") or {}).get("train_time_s"),
              "seconds": time.perf_counter() - t0,
              "command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
                          "threads": __import__("torch").get_num_threads()}}
    atomic_write_json(args.out / "rule_following.json", result)
    md = [f"# DPO teaches a rule: {result['rule']}", "",
          f"`{result['command']}` ({args.pairs} pairs, {args.steps} LoRA DPO steps, beta {args.beta}, lr {args.lr}; "
          f"load average {result['machine']['loadavg'][0]:.1f} on {result['machine']['cpus']} CPUs)", "",
          "| model | follows the rule (greedy, held-out prompts) | ± stderr | n |", "|---|---|---|---|",
          f"| base | {before['rate']:.1%} | {before['stderr']:.1%} | {before['n']} |",
          f"| after DPO | {after['rate']:.1%} | {after['stderr']:.1%} | {after['n']} |", "",
          f"Last logged DPO step: {result['dpo_last']}.", "",
          "Examples after: " + "; ".join(f"`{t!r}`" for t in after["examples"]), ""]
    atomic_write_text(args.out / "rule_following.md", "\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
