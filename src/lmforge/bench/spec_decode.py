"""`python -m lmforge.bench.spec_decode`: speculative decoding (ngram prompt lookup and a draft model)
against plain decoding, on the same greedy requests, at batch 1 and at `--concurrency` requests at once.

Workloads (token ids, fixed seed), both built so that a continuation that copies the prompt is the
natural one: `code-edit` (a "file" of 24 lines of 12 tokens, an instruction, then the file's first two
lines again: the rest of the file is the expected edit) and `quote` (a 300-token document, a "summary"
marker, then the start of a 16-token quote from it). Every request asks for `--max-tokens` tokens
(EOS ignored). Batch 1 runs the requests one after another; `--concurrency` c adds c of them at once.
Reported per system: output tokens/s, the speedup over plain decoding, whether every greedy output is
the plain engine's token for token, the acceptance rate and the mean tokens a verification yields. In bfloat16 "identical" can read NO
at concurrency > 1 without any fault in speculation: plain bf16 decoding is itself not invariant to
the batch's shape (a matmul of 16 rows and one of 80 round differently, and a random model's nearly
flat logits flip on that); in float32 every output matches.

Without `--model`, the random ~30M Llama of `lmforge bench engine` is built under `--out`; without
`--draft-model`, the draft is that target quantized to w8a16 (RTN): the only draft that agrees with a
random model often, since a random model's logits are nearly flat (a smaller random model, or the
target's first layers, agree on almost no token). Random weights do not copy spans of their prompt:
the ngram acceptance measured there comes from the loops greedy decoding falls into. Rerun with a
trained target and draft (`--model`, `--draft-model`) for numbers that mean something for a product.

    python -m lmforge.bench.spec_decode --out runs/bench-spec-decode
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import torch
import typer

from lmforge.engine import EngineConfig, LLMEngine, SamplingParams
from lmforge.quant.quantize import QuantizeConfig, quantize_model
from lmforge.track.progress import Progress
from lmforge.track.short import shrink

from .engine import random_model
from .report import emit, loadavg, provenance

WORKLOADS = ("code-edit", "quote")


def make_prompts(workload: str, n: int, seed: int, vocab_size: int) -> list[list[int]]:
    """`n` prompts whose natural continuation copies a span of the prompt (see the module docstring)."""
    rng = random.Random(f"{workload}-{seed}")
    tok = lambda k: [rng.randrange(3, vocab_size) for _ in range(k)]  # noqa: E731 (ids 0-2 are special)
    prompts = []
    for _ in range(n):
        if workload == "code-edit":
            lines = [tok(11) + [10] for _ in range(24)]  # id 10 plays the newline
            prompts.append(sum(lines, []) + tok(8) + sum(lines[:2], []))
        else:
            doc = tok(300)
            start = rng.randrange(0, 300 - 16)
            prompts.append(doc + tok(4) + doc[start:start + 6])
    return prompts


def run_system(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict[str, Any]:
    """Greedy outputs of `prompts`, `concurrency` at a time; wall seconds and the spec counters' deltas."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    before, outputs = engine.stats(), {}
    t0 = time.perf_counter()
    for first in range(0, len(prompts), concurrency):
        for i in range(first, min(first + concurrency, len(prompts))):
            engine.add_request(str(i), prompts[i], params)
        while engine.has_unfinished_requests():
            outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    seconds = time.perf_counter() - t0
    after = engine.stats()
    tokens = sum(len(t) for t in outputs.values())
    row = dict(seconds=round(seconds, 3), output_tokens=tokens, tok_s=round(tokens / seconds, 2),
               steps=after["steps"] - before["steps"], outputs=[outputs[str(i)] for i in range(len(prompts))])
    if "spec_decode_num_drafts" in after:
        d = {k: after[k] - before[k] for k in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                               "spec_decode_num_accepted_tokens")}
        row.update(acceptance_rate=round(d["spec_decode_num_accepted_tokens"] / max(d["spec_decode_num_draft_tokens"], 1), 3),
                   tokens_per_verification=round(1 + d["spec_decode_num_accepted_tokens"]
                                                 / max(d["spec_decode_num_drafts"], 1), 3), **d)
    return row


def default_draft(target: Path, out: Path) -> Path:
    """The target quantized to w8a16 (RTN), built once under `out`."""
    path = out / f"{target.name}-w8a16-draft"
    if not (path / "config.json").exists():
        quantize_model(QuantizeConfig(model=str(target), out=str(path), scheme="w8a16"), overwrite=True)
    return path


def bench_run(model: Path, draft: Path, dtype: str, k: int, num_requests: int, concurrency: int,
              max_tokens: int, seed: int) -> dict[str, Any]:
    systems = {"plain": {}, "ngram": dict(speculative_method="ngram", num_speculative_tokens=k),
               "draft": dict(speculative_model=str(draft), num_speculative_tokens=k)}
    blocks = concurrency * -(-(400 + max_tokens + k) // 16) + 16  # the longest prompt is ~330 tokens
    engines = {name: LLMEngine(EngineConfig(model=str(model), dtype=dtype, seed=seed, num_kv_blocks=blocks, **cfg))
               for name, cfg in systems.items()}
    vocab = engines["plain"].vocab_size
    for e in engines.values():  # warm-up: first-call costs (kernel loads, allocator) out of the timings
        run_system(e, make_prompts(WORKLOADS[0], 1, -1, vocab), 8, 1)
    rows = []
    bar = Progress("bench spec-decode", total=len(WORKLOADS) * 2 * len(engines), unit="runs", heartbeat=True)
    for workload in WORKLOADS:
        for c, n in ((1, num_requests), (concurrency, concurrency)):
            prompts = make_prompts(workload, n, seed + c, vocab)
            results = {}
            for name, e in engines.items():
                results[name] = run_system(e, prompts, max_tokens, c)
                bar.update(bar.done + 1, postfix=f"{workload}, concurrency {c}, {name}")
            base = results["plain"]
            for name, r in results.items():
                r.update(workload=workload, concurrency=c, system=name, speedup=round(r["tok_s"] / base["tok_s"], 3),
                         identical=r["outputs"] == base["outputs"])
            for r in results.values():
                del r["outputs"]
                rows.append(r)
    bar.close()
    return dict(rows=rows, model=str(model), draft_model=str(draft), num_speculative_tokens=k, dtype=dtype,
                max_tokens=max_tokens, num_requests_batch1=num_requests, concurrency=concurrency)


def to_markdown(report: dict[str, Any]) -> str:
    p = report["provenance"]
    lines = [f"# Speculative decoding vs plain decode ({p['date']}, {p['threads']} thread(s), {report['dtype']})", "",
             f"Target `{report['model']}`, draft `{report['draft_model']}`, K = {report['num_speculative_tokens']}, "
             f"{report['max_tokens']} greedy tokens per request. Load average {p['load_average']} before, "
             f"{report['load_average_after']} after: measured on a busy machine unless it says ~0.", "",
             "| workload | concurrency | system | tok/s | speedup | identical | acceptance | tokens/verification | steps |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["rows"]:
        lines.append(f"| {r['workload']} | {r['concurrency']} | {r['system']} | {r['tok_s']:.1f} | {r['speedup']:.2f}x | "
                     f"{'yes' if r['identical'] else 'NO'} | {r.get('acceptance_rate', '')} | "
                     f"{r.get('tokens_per_verification', '')} | {r['steps']} |")
    return "\n".join(lines) + "\n"


def main(
    model: Annotated[Optional[Path], typer.Option(help="Target model dir (default: a random ~30M Llama).")] = None,
    draft_model: Annotated[Optional[Path], typer.Option(help="Draft model dir (default: the target, w8a16).")] = None,
    num_speculative_tokens: Annotated[int, typer.Option(help="K, tokens proposed per step.")] = 4,
    num_requests: Annotated[int, typer.Option(help="Requests run one at a time (batch 1).")] = 4,
    concurrency: Annotated[int, typer.Option(help="Requests at once in the second run.")] = 16,
    max_tokens: Annotated[int, typer.Option(help="Greedy tokens per request.")] = 128,
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16.")] = "bfloat16",
    threads: Annotated[int, typer.Option(help="torch intra-op threads.")] = 1,
    seed: Annotated[int, typer.Option(help="Workload seed.")] = 0,
    out: Annotated[Optional[Path], typer.Option(help="Write spec_decode.json and .md here.")] = None,
) -> None:
    """Speculative decoding (ngram, draft model) vs plain decode at batch 1 and at --concurrency."""
    torch.set_num_threads(threads)
    work = out or Path("runs/bench-spec-decode")
    work.mkdir(parents=True, exist_ok=True)
    target = model or random_model(work)
    draft = draft_model or default_draft(target, work)
    report = dict(provenance=provenance(dtype))
    # LMFORGE_SHORT (CI): one request at batch 1, two at once, 16 tokens each, on the short random model
    num_requests, concurrency, max_tokens = shrink(num_requests, 1), shrink(concurrency, 2), shrink(max_tokens, 16)
    report.update(bench_run(target, draft, dtype, num_speculative_tokens, num_requests, concurrency, max_tokens, seed))
    report["load_average_after"] = loadavg()
    report["command"] = "python -m lmforge.bench.spec_decode " + " ".join(sys.argv[1:])
    emit(report, to_markdown, out, "spec_decode")


if __name__ == "__main__":
    typer.run(main)
