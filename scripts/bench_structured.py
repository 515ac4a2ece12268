"""Structured-output overhead per generated token, constrained vs unconstrained, in the offline engine:

    python scripts/bench_structured.py --out runs/bench-structured [--model DIR] [--batch 1,16] [--tokens 128]

Both arms decode the same prompts for exactly `--tokens` tokens at each batch size (greedy; the same
logit_bias in both, so the sampler takes the same path and the difference is the grammar's: mask fill,
unpack, apply, and the matcher's advance). The constrained arm's grammar is a JSON schema that cannot end
inside the budget: an array of objects (a bounded string, an integer, an enum) whose closing ']' is banned
by that logit_bias. Arms alternate for `--rounds` rounds; the overhead is the median of the per-round
ratios of seconds per token, minus one (target <= 10%), in wall time and in this process's CPU time (which
a busy neighbour moves far less than wall time; with `--threads 1` the two measure the same work).

Without `--model` it builds the tiny random Llama with a trained tokenizer that the tests use (vocabulary
512: a floor on the model's cost, so a ceiling on the relative overhead). Writes bench_structured.json and
bench_structured.md with the machine, versions and load average.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lmforge.engine import LLM, SamplingParams
from lmforge.engine.sampling_params import StructuredOutputsParams
from lmforge.track.io import atomic_write_json, atomic_write_text
from lmforge.track.short import shrink

SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "count": {"type": "integer", "minimum": 0, "maximum": 9999},
    "kind": {"enum": ["alpha", "beta", "gamma"]}}, "required": ["name", "count", "kind"]}}
PROMPTS = ["The city of", "model token server", "Hello there", "import data", "the river and", "a new school"]


def closing_bias(llm: LLM) -> dict[int, float]:
    """-100 on EOS and on every token whose text holds ']': the array (and so the grammar) never ends."""
    tok, engine = llm.get_tokenizer(), llm.llm_engine
    banned = [t for t in range(min(len(tok), engine.vocab_size)) if "]" in tok.decode([t])]
    return {t: -100.0 for t in (banned + sorted(engine.eos_token_ids))[:300]}


def run_arm(llm: LLM, batch: int, tokens: int, bias: dict[int, float], constrained: bool) -> tuple[float, float, int]:
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True) if constrained else None
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logit_bias=bias,
                            structured_outputs=so)
    prompts = [PROMPTS[i % len(PROMPTS)] + f" {i}" for i in range(batch)]
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    if n != batch * tokens:
        raise RuntimeError(f"an arm ended early ({n} of {batch * tokens} tokens): the budget must not let the "
                           "grammar finish; lower --tokens")
    return seconds, cpu_seconds, n


def measure(llm: LLM, batch: int, tokens: int, rounds: int) -> dict:
    bias = closing_bias(llm)
    run_arm(llm, batch, 8, bias, True)  # warm-up: compile the grammar, build the tokenizer, touch the kernels
    run_arm(llm, batch, 8, bias, False)
    per_token: dict[tuple[str, bool], list[float]] = {(k, c): [] for k in ("wall", "cpu") for c in (False, True)}
    for r in range(rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for c in order:
            wall, cpu, n = run_arm(llm, batch, tokens, bias, c)
            per_token["wall", c].append(wall / n)
            per_token["cpu", c].append(cpu / n)
    out = dict(batch=batch, tokens_per_request=tokens, rounds=rounds)
    for k in ("wall", "cpu"):
        ratios = [b / a for a, b in zip(per_token[k, False], per_token[k, True])]
        out[k] = dict(plain_ms_per_token=1e3 * statistics.median(per_token[k, False]),
                      constrained_ms_per_token=1e3 * statistics.median(per_token[k, True]),
                      overhead=statistics.median(ratios) - 1, overhead_per_round=[x - 1 for x in ratios])
    return out


def tiny_model(root: Path) -> Path:
    from lmforge.serve.testing import make_model_with_tokenizer  # only when no --model is given
    return make_model_with_tokenizer(root / "model", root / "tok")


def to_markdown(report: dict) -> str:
    lines = [f"# Structured-output overhead ({report['date']})", "",
             f"`{report['command']}`", "",
             f"Machine: {report['machine']}; load average at start {report['loadavg']}; torch threads "
             f"{report['threads']}. Model: {report['model']} (vocabulary {report['vocab_size']}).", "",
             "| batch | clock | plain ms/token | constrained ms/token | overhead (median of rounds) |",
             "| --- | --- | --- | --- | --- |"]
    for r in report["results"]:
        for k in ("wall", "cpu"):
            m = r[k]
            lines.append(f"| {r['batch']} | {k} | {m['plain_ms_per_token']:.3f} | {m['constrained_ms_per_token']:.3f} "
                         f"| {100 * m['overhead']:+.1f}% |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/bench-structured"))
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    a = ap.parse_args()
    # LMFORGE_SHORT (CI): 16 tokens, one round, batches of at most 4: the same arms, not figures to quote
    a.tokens, a.rounds = shrink(a.tokens, 16), shrink(a.rounds, 1)
    a.batch = ",".join(str(shrink(int(b), 4)) for b in a.batch.split(","))
    if a.threads:
        torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or tiny_model(Path(tmp))
        llm = LLM(str(model), device="cpu")
        report = dict(command="python scripts/bench_structured.py " + " ".join(os.sys.argv[1:]),
                      date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                      machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                      loadavg=os.getloadavg(), threads=torch.get_num_threads(),
                      model=str(a.model or "tiny random Llama (tests' chat model)"),
                      vocab_size=llm.llm_engine.vocab_size, torch=torch.__version__,
                      results=[measure(llm, int(b), a.tokens, a.rounds) for b in a.batch.split(",")])
    a.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(a.out / "bench_structured.json", report)
    atomic_write_text(a.out / "bench_structured.md", to_markdown(report))
    print(to_markdown(report))


if __name__ == "__main__":
    main()
