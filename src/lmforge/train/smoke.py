"""`lmforge smoke CONFIG`: the user's own chain on about 1% of the data for a few steps, to learn
what would break before the real run does ("先跑通1%的数据再放量到100%").

Stages, each reported ok / failed with its error and what to do, none skipped silently:

1. config: load and validate, model dims (alignment warnings), the memory estimate against the
   free memory (the same pre-flight `train` runs);
2. train: ~1% of the train split's rows (at least 2, at most `max_steps` steps) with one
   evaluation and one checkpoint at the end, into OUT/train; loss finite and falling is checked;
3. resume: one more step from that checkpoint (`--resume`), so a crash mid-run is recoverable;
4. export: the checkpoint as a Hugging Face folder (OUT/model);
5. generate: the exported model through the inference engine, a few greedy tokens.

OUT/smoke.json and OUT/smoke.md hold the table. It knows the stages' public functions only.

    lmforge smoke configs/quickstart.yaml data.path=runs/quickstart/packed --out runs/smoke
"""

from __future__ import annotations

import json
import math
import shutil
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from lmforge.config import load_config
from lmforge.perf.estimate import fmt_bytes
from lmforge.track.io import atomic_write_json, atomic_write_text
from lmforge.track.runs import read_metrics

from .config import TrainConfig
from .guards import preflight_train, shape_for

FRACTION = 0.01


def _stage(results: list[dict], name: str, fn: Callable[[], str]) -> bool:
    t0 = time.perf_counter()
    try:
        detail, status = fn(), "ok"
    except Exception as e:  # noqa: BLE001 - the point is to report what breaks, whatever it is
        detail, status = f"{type(e).__name__}: {e}".strip(), "failed"
        tb = traceback.extract_tb(e.__traceback__)
        if tb:
            detail += f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno})"
    results.append({"stage": name, "status": status, "detail": detail, "seconds": round(time.perf_counter() - t0, 2)})
    print(f"{'✓' if status == 'ok' else '✗'} {name}: {detail}", flush=True)
    return status == "ok"


def smoke(config: str, overrides: list[str], out: Path, max_steps: int = 20, steps: int | None = None) -> dict[str, Any]:
    """Run the stages; `steps` fixes the training steps (default ~1% of the rows, 2 to `max_steps`)."""
    out = Path(out)
    results: list[dict] = []
    state: dict[str, Any] = {}
    stages = (("config", lambda: _config_stage(config, overrides, max_steps, steps, state)),
              ("train", lambda: _train_stage(out, state)), ("resume", lambda: _resume_stage(out, state)),
              ("export", lambda: _export_stage(out)), ("generate", lambda: _generate_stage(out)))
    ok = True
    for name, fn in stages:
        if ok:
            ok = _stage(results, name, fn)
        else:
            results.append({"stage": name, "status": "not run", "detail": "an earlier stage failed", "seconds": 0})
    summary = {"config": config, "overrides": overrides, "stages": results,
               "passed": all(r["status"] == "ok" for r in results)}
    _write_report(out, config, overrides, summary)
    return summary


def _config_stage(config: str, overrides: list[str], max_steps: int, steps: int | None, state: dict) -> str:
    """Load and validate; the step count (~1% of the train rows); the memory pre-flight; alignment warnings."""
    cfg = load_config(TrainConfig, config, overrides).validate()
    state["cfg"] = cfg
    manifest = Path(cfg.data.path) / "manifest.json"
    if cfg.train.stage == "pretrain":
        if not manifest.is_file():
            raise FileNotFoundError(f"data.path={cfg.data.path}: no manifest.json (run `lmforge data pack`)")
        m = json.loads(manifest.read_text())
        rows = int(m["splits"]["train"]["rows"])
        state["seq_len"], vocab = int(m["seq_len"]), int(m["vocab_size"])
    else:
        rows, state["seq_len"], vocab = 100 * cfg.train.batch_size, cfg.train.seq_len, cfg.model.vocab_size or 0
    n = steps or max(2, min(max_steps, math.ceil(FRACTION * rows / cfg.train.batch_size)))
    state["steps"] = n
    # deferred: torch (lmforge.model imports it) loads only when a smoke runs, not for `lmforge --help`
    import torch

    from lmforge.model.config import ModelConfig, alignment_warnings

    shape = shape_for(cfg, vocab or 1)
    est = preflight_train(cfg, shape, state["seq_len"], torch.device("cuda" if torch.cuda.is_available() and
                                                                      cfg.train.device in ("auto", "cuda") else "cpu"))
    warn = []
    if not cfg.model.init:
        warn = alignment_warnings(ModelConfig(vocab_size=shape.vocab, hidden_size=shape.hidden,
                                              intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                                              num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                                              head_dim=shape.head_dim))
    return (f"{shape.params():,} params, memory estimate {fmt_bytes(est.total + est.overhead)}; "
            f"{n} steps = {n * cfg.train.batch_size} of {rows} train rows"
            + ("; " + "; ".join(warn) if warn else ""))


def _train_stage(out: Path, state: dict) -> str:
    """~1% of the rows, one evaluation and one checkpoint at the end; the loss must be finite."""
    # deferred: the trainer (torch) loads only when a smoke runs
    from .loop import Trainer

    cfg = _with(state["cfg"], max_steps=state["steps"], eval_every=0, ckpt_every=0, eval_batches=1, log_every=0)
    rec = Trainer(cfg, out / "train", overwrite=True).fit()
    res = rec.get("results", rec)
    losses = [r["loss"] for r in read_metrics(out / "train") if "loss" in r]
    if not losses or not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"non-finite loss: {losses}")
    falling = losses[-1] < losses[0]
    warnings = res.get("warnings") or []
    return (f"loss {losses[0]:.3f} -> {losses[-1]:.3f}" + ("" if falling else " (not falling: check lr and data)")
            + f", val_loss {res.get('final_val_loss')}, {res.get('tokens_per_s')} tok/s"
            + (f"; {len(warnings)} warning(s): " + "; ".join(warnings[:3]) if warnings else ""))


def _resume_stage(out: Path, state: dict) -> str:
    """One more step from the train stage's checkpoint (`--resume`)."""
    # deferred: as in _train_stage
    from .loop import Trainer

    cfg = _with(state["cfg"], max_steps=state["steps"] + 1, eval_every=0, ckpt_every=0, eval_batches=1,
                log_every=0)
    rec = Trainer(cfg, out / "train", resume=True).fit()
    return f"resumed to step {rec.get('results', rec).get('steps')}"


def _export_stage(out: Path) -> str:
    # deferred: export loads torch and safetensors
    from .export import export_run

    shutil.rmtree(out / "model", ignore_errors=True)  # a previous smoke's export: ours to replace
    return f"HF folder {export_run(out / 'train', out / 'model')}"


def _generate_stage(out: Path) -> str:
    # deferred: the inference engine is heavy and only this stage needs it
    from lmforge.engine import LLM, SamplingParams

    llm = LLM(str(out / "model"), device="cpu", max_num_seqs=2, num_kv_blocks=64)
    text = llm.generate(["def "], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)[0].outputs[0].text
    return f"greedy continuation of 'def ': {text!r}"


def _write_report(out: Path, config: str, overrides: list[str], summary: dict) -> None:
    """OUT/smoke.json and the table in OUT/smoke.md."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "smoke.json", summary)
    md = ["# Smoke run", "", f"`lmforge smoke {config} {' '.join(overrides)}`", "",
          "| stage | status | seconds | detail |", "|---|---|---|---|"]
    md += [f"| {r['stage']} | {r['status']} | {r['seconds']} | {r['detail']} |" for r in summary["stages"]]
    atomic_write_text(out / "smoke.md", "\n".join(md) + "\n")


def _with(cfg: Any, **train: Any) -> Any:
    return replace(cfg, train=replace(cfg.train, **train))


def smoke_cmd(
    config: Annotated[Path, typer.Argument(help="Training YAML config.")],
    overrides: Annotated[Optional[list[str]], typer.Argument(metavar="[KEY=VALUE]...", help="Dotted overrides.")] = None,
    out: Annotated[Path, typer.Option("--out", help="Folder for the smoke run and smoke.md.")] = Path("runs/smoke"),
    max_steps: Annotated[int, typer.Option(help="At most this many training steps (1% of the rows, at least 2).")] = 20,
    steps: Annotated[Optional[int], typer.Option(help="Exactly this many training steps instead.")] = None,
) -> None:
    """Run CONFIG's chain on ~1% of the data (config + memory pre-flight, train, resume, export,
    generate) and report what would break before the real run; exit 1 when a stage fails."""
    summary = smoke(str(config), list(overrides or []), out, max_steps, steps)
    print(f"smoke: {'passed' if summary['passed'] else 'FAILED'} -> {out / 'smoke.md'}")
    if not summary["passed"]:
        raise typer.Exit(1)
