"""`lmforge bench grpo`: rollout throughput of lmforge's engine vs `transformers.generate`, and where one
GRPO step's time goes.

Both systems get the same chat-templated prompts, the same group size and the same lengths: every
sample is exactly `--max-tokens` new tokens (`ignore_eos` in the engine, `min_new_tokens` in
transformers), sampled at temperature 1, float32, as GRPO runs them. transformers generates all
prompts x group in one left-padded batch with its KV cache (what TRL's GRPOTrainer does without
vLLM). The systems run alternately `--repeats` times and the best of each is kept; the
ratio is taken within one run on one machine; the load (`os.getloadavg()`) is recorded
at start and end, since a shared machine moves both numbers. Then `--steps` GRPO steps run on
the same model and prompts (`lmforge.train.grpo.trainer`) and the last one's split (rollout,
update, weight sync) is reported.

With `--trl-python PY` (an interpreter with TRL: `make trl-env` builds `.venv-trl`), the same number of
steps of TRL's `GRPOTrainer` run on the same model, the same prompts (the first `--prompts` tasks, one
step each covering all of them), group size, `max_tokens` cap, temperature 1, beta 0, one pass and
token-level loss (`scripts/bench_trl_grpo.py`), and the last step of each is compared: total, rollout
and update seconds. Both stop a sample at EOS here, so the sampled lengths are reported beside the times.

Writes OUT/bench_grpo.json and OUT/bench_grpo.md.

    lmforge bench grpo runs/reasoning/sft-model --tasks runs/reasoning/train.jsonl --out runs/bench-grpo \
        --trl-python .venv-trl/bin/python
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import torch
import typer

from lmforge.bench.report import emit, loadavg
from lmforge.config import load_config
from lmforge.data.synth import read_tasks
from lmforge.tokenizer.load import load_tokenizer
from lmforge.track.provenance import hardware_info, package_versions
from lmforge.track.runs import read_metrics
from lmforge.train.config import TrainConfig


def engine_rollouts(model_dir: str, prompt_ids: list[list[int]], group: int, max_tokens: int, seed: int) -> dict:
    # deferred: only when the benchmark runs; `lmforge --help` imports this module
    from lmforge.engine import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32", device="cpu", pack_weights=False, max_num_seqs=256)
    params = [SamplingParams(n=group, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0,
                             seed=seed + i) for i in range(len(prompt_ids))]
    llm.generate(prompt_ids[:1], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompt_ids, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"system": "lmforge engine (LLM, float32, logprobs)", "seconds": round(dt, 3), "tokens": tokens,
            "tokens_per_s": round(tokens / dt, 1)}


def hf_rollouts(model_dir: str, prompt_ids: list[list[int]], group: int, max_tokens: int, seed: int) -> dict:
    import transformers  # deferred: transformers, only for the baselines that run it

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = [p for p in prompt_ids for _ in range(group)]
    L = max(len(r) for r in rows)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (L - len(r)) + r for r in rows])  # left padding, as TRL generates
    mask = torch.tensor([[0] * (L - len(r)) + [1] * len(r) for r in rows])
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_tokens,
              min_new_tokens=max_tokens, pad_token_id=pad, output_scores=True, return_dict_in_generate=True)
    with torch.inference_mode():
        model.generate(ids[:1], attention_mask=mask[:1], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kw)
        dt = time.perf_counter() - t0
    tokens = int((out.sequences[:, L:] != -1).sum())
    return {"system": f"transformers {transformers.__version__} generate (batch {len(rows)}, KV cache, scores)",
            "seconds": round(dt, 3), "tokens": tokens, "tokens_per_s": round(tokens / dt, 1)}


def grpo_step_split(model_dir: str, tasks: str, prompts: int, group: int, max_tokens: int, steps: int,
                    out: Path) -> dict:
    # deferred: only when the benchmark runs; `lmforge --help` imports this module
    from lmforge.train.grpo.trainer import train_grpo

    cfg = load_config(TrainConfig, None, [
        "train.stage=grpo", f"model.init={model_dir}", f"data.path={tasks}", f"train.max_steps={steps}",
        "train.dtype=float32", "train.ckpt_every=0", "train.log_every=0", "train.lr=1e-5", "train.warmup_steps=0",
        f"grpo.prompts_per_step={prompts}", f"grpo.group_size={group}", f"grpo.max_tokens={max_tokens}"])
    train_grpo(cfg, out / "grpo-run", overwrite=True)

    last = [m for m in read_metrics(out / "grpo-run") if "rollout_s" in m][-1]
    keys = ("rollout_s", "update_s", "sync_s", "dt_s", "rollout_tokens", "rollout_tokens_per_s",
            "update_tokens_per_s", "response_len_mean")
    return {k: last[k] for k in keys}


def trl_step(python: str, model_dir: str, tasks: str, prompts: int, group: int, max_tokens: int, steps: int,
             out: Path) -> dict:
    """TRL's GRPOTrainer on the same inputs, in its own interpreter (scripts/bench_trl_grpo.py)."""
    script = Path(__file__).resolve().parents[4] / "scripts" / "bench_trl_grpo.py"
    if not script.is_file():
        raise FileNotFoundError(f"{script}: the TRL baseline script ships with the repository checkout")
    cmd = [python, str(script), "--model", model_dir, "--tasks", tasks, "--prompts", str(prompts),
           "--group-size", str(group), "--max-tokens", str(max_tokens), "--steps", str(max(steps, 2)),
           "--lr", "1e-5", "--out", str(out / "trl.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-4000:])
        raise RuntimeError(f"the TRL baseline failed (exit {proc.returncode}): {' '.join(cmd)}")
    r = json.loads((out / "trl.json").read_text())
    r["command"] = " ".join(cmd)
    return r


def bench_grpo(
    model: Annotated[Path, typer.Argument(help="Model folder (HF layout with a chat template).")],
    tasks: Annotated[Path, typer.Option("--tasks", help="Task JSONL (prompts are taken from its first rows).")],
    out: Annotated[Path, typer.Option("--out", help="Folder for bench_grpo.json and .md.")] = Path("runs/bench-grpo"),
    prompts: Annotated[int, typer.Option("--prompts", help="Distinct prompts.")] = 8,
    group: Annotated[int, typer.Option("--group-size", help="Samples per prompt.")] = 8,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="New tokens per sample (exactly).")] = 128,
    steps: Annotated[int, typer.Option("--steps", help="GRPO steps for the rollout/update split (0: skip).")] = 2,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    repeats: Annotated[int, typer.Option(help="Alternating timed runs of each system (best kept).")] = 2,
    trl_python: Annotated[Optional[str], typer.Option("--trl-python", help=(
        "Interpreter with TRL installed (`make trl-env`: .venv-trl/bin/python): also time TRL's GRPOTrainer "
        "steps on the same inputs."))] = None,
) -> None:
    """Rollout tokens/s: lmforge's engine vs transformers.generate on the same prompts, group size and
    lengths (ratio in one run), plus one GRPO step's split between rollout, update and weight sync."""
    # deferred: only when the benchmark runs; `lmforge --help` imports this module
    from lmforge.train.grpo.rollout import chat_prompt_ids

    tok = load_tokenizer(model)
    chosen = read_tasks(tasks)[:prompts]
    prompt_ids = [chat_prompt_ids(tok, t["prompt"]) for t in chosen]
    out.mkdir(parents=True, exist_ok=True)
    step_tasks = out / "tasks.jsonl"  # the GRPO steps of both systems see exactly these prompts
    step_tasks.write_text("".join(json.dumps({k: t[k] for k in ("prompt", "answer")}) + "\n" for t in chosen))
    report: dict[str, Any] = {"model": str(model), "prompts": len(prompt_ids), "group_size": group,
                              "max_tokens": max_tokens, "threads": torch.get_num_threads(),
                              "load_start": loadavg(), "hardware": hardware_info(), "packages": package_versions()}
    runs: dict[str, list[dict]] = {"engine": [], "hf": []}
    for _ in range(repeats):  # alternated, best of each: a shared machine's load moves between runs
        runs["engine"].append(engine_rollouts(str(model), prompt_ids, group, max_tokens, seed))
        runs["hf"].append(hf_rollouts(str(model), prompt_ids, group, max_tokens, seed))
    eng, hf = (max(runs[k], key=lambda r: r["tokens_per_s"]) for k in ("engine", "hf"))
    for best, k in ((eng, "engine"), (hf, "hf")):
        best["all_tokens_per_s"] = [r["tokens_per_s"] for r in runs[k]]
    report["systems"] = [eng, hf]
    report["engine_over_transformers"] = round(eng["tokens_per_s"] / hf["tokens_per_s"], 2)
    if steps or trl_python:
        report["grpo_step"] = grpo_step_split(str(model), str(step_tasks), prompts, group, max_tokens,
                                              max(steps, 2), out)
    if trl_python:
        t = report["trl_step"] = trl_step(trl_python, str(model), str(step_tasks), prompts, group, max_tokens,
                                          steps, out)
        g = report["grpo_step"]
        report["lmforge_over_trl"] = {"step": round(t["last_step_s"] / g["dt_s"], 2),
                                      "rollout": round(t["last_rollout_s"] / g["rollout_s"], 2),
                                      "update": round(t["last_update_s"] / g["update_s"], 2)}
    report["load_end"] = loadavg()
    emit(report, to_markdown, out, "bench_grpo")


def to_markdown(r: dict) -> str:
    lines = [f"# bench grpo: {r['model']}", "",
             f"{r['prompts']} prompts x group {r['group_size']}, exactly {r['max_tokens']} new tokens each, float32, "
             f"{r['threads']} torch threads; load {r['load_start']} -> {r['load_end']}", "",
             "| system | tokens | seconds (best) | tokens/s (best) | tokens/s (every run) |",
             "| --- | ---: | ---: | ---: | --- |"]
    lines += [f"| {s['system']} | {s['tokens']:,} | {s['seconds']} | {s['tokens_per_s']:,} | "
              f"{', '.join(f'{x:,}' for x in s['all_tokens_per_s'])} |" for s in r["systems"]]
    lines += ["", f"engine / transformers: **{r['engine_over_transformers']}x**"]
    if "grpo_step" in r:
        g = r["grpo_step"]
        lines += ["", "one lmforge GRPO step (the last of the run): "
                  f"rollout {g['rollout_s']} s, update {g['update_s']} s, weight sync {g['sync_s']} s, "
                  f"total {g['dt_s']} s ({g['rollout_tokens']} tokens sampled, mean length {g['response_len_mean']:.0f})"]
    if "trl_step" in r:
        t, g, x = r["trl_step"], r["grpo_step"], r["lmforge_over_trl"]
        lines += ["", "One GRPO step on the same prompts, group and cap (the last of each run; samples end at "
                  "EOS):", "",
                  "| system | step s | rollout s | update s | sampled tokens |", "| --- | ---: | ---: | ---: | ---: |",
                  f"| lmforge (engine rollouts) | {g['dt_s']:.2f} | {g['rollout_s']:.2f} | {g['update_s']:.2f} | "
                  f"{g['rollout_tokens']:,} |",
                  f"| {t['system']} | {t['last_step_s']:.2f} | {t['last_rollout_s']:.2f} | {t['last_update_s']:.2f} | "
                  f"{t['last_completion_tokens']:,} |", "",
                  f"lmforge / TRL speed: step **{x['step']}x**, rollout {x['rollout']}x, update {x['update']}x"]
    return "\n".join(lines) + "\n"
