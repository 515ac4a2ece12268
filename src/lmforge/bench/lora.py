"""`python -m lmforge.bench.lora`: multi-LoRA serving (engine/lora.py) against the merged model alone.

The same greedy workload (`--num-requests` random prompts of `--prompt-len` tokens, `--max-tokens` output
tokens each, EOS ignored, `--concurrency` at a time) runs on three engines:

* `merged`: one adapter merged into the base (`lmforge.train.lora.merge_lora`), no LoRA machinery: the
  speed a single fine-tuned model gets;
* `multi-lora`: the base with `--adapters` adapters resident (`max_loras` = their number), the requests
  dealt round-robin over them, so every step mixes all of them;
* `lora-engine, base rows`: the LoRA engine on requests without adapter (what enabling LoRA costs them).

Reported: output tokens/s, the ratio to `merged` (issue 26's target: multi-LoRA >= 0.8x), and whether
the requests on the merged adapter got the merged model's tokens (in float32 they must; in bfloat16 the
two orders of rounding may flip a near-tie of a random model).

Adapters are random (rank `--rank`, every linear of every layer, B ~ N(0, 0.02^2)) peft folders written
by `lmforge.train.lora_adapter.save_adapter`; the base, without `--model`, is the random ~30M Llama of
`lmforge bench engine`. Speed does not depend on the adapters' values.

    python -m lmforge.bench.lora --out runs/bench-lora
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import torch
import typer

from lmforge.engine import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from lmforge.model import Transformer
from lmforge.train.lora import LoraConfig, apply_lora, merge_lora
from lmforge.train.lora_adapter import save_adapter
from lmforge.track.short import shrink

from .engine import random_model
from .report import emit, loadavg, provenance

ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base: Path, out: Path, n: int, rank: int) -> list[Path]:
    """`n` random peft folders over `base` (built once under `out`); the first one is also merged."""
    paths = [out / f"adapter-r{rank}-{i}" for i in range(n)]
    for i, path in enumerate(paths):
        if (path / "adapter_config.json").exists() and (i or (out / f"merged-r{rank}-0" / "config.json").exists()):
            continue
        cfg = LoraConfig(rank=rank, alpha=2 * rank, target_modules=ALL_LINEARS)
        model = apply_lora(Transformer.from_pretrained(base, dtype="float32"), cfg)
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * (0.02 if ".lora_B." in name else 1 / rank ** 0.5))
        save_adapter(model, cfg, path, base=str(base))
        if i == 0:
            merge_lora(model, inplace=True).save_pretrained(out / f"merged-r{rank}-0")
    return paths


def run_system(engine: LLMEngine, prompts: list[list[int]], loras: list[LoRARequest | None], max_tokens: int,
               concurrency: int) -> dict[str, Any]:
    """Greedy outputs, `concurrency` requests in flight (a finished one is replaced at once); wall seconds."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs, nxt = {}, 0
    t0 = time.perf_counter()
    while nxt < len(prompts) or engine.has_unfinished_requests():
        while nxt < len(prompts) and len(engine.requests) < concurrency:
            engine.add_request(str(nxt), prompts[nxt], params, lora_request=loras[nxt])
            nxt += 1
        outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    seconds = time.perf_counter() - t0
    tokens = sum(len(t) for t in outputs.values())
    return dict(seconds=round(seconds, 3), output_tokens=tokens, tok_s=round(tokens / seconds, 2),
                outputs=[outputs[str(i)] for i in range(len(prompts))])


def bench_run(base: Path, adapters: list[Path], merged: Path, rank: int, dtype: str, num_requests: int,
              prompt_len: int, max_tokens: int, concurrency: int, seed: int) -> dict[str, Any]:
    common = dict(dtype=dtype, seed=seed, max_num_seqs=concurrency)
    merged_engine = LLMEngine(EngineConfig(model=str(merged), **common))
    lora_engine = LLMEngine(EngineConfig(model=str(base), enable_lora=True, max_loras=len(adapters),
                                         max_lora_rank=rank, **common))
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, merged_engine.vocab_size) for _ in range(prompt_len)] for _ in range(num_requests)]
    reqs = [LoRARequest(f"adapter-{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    mixed = [reqs[i % len(reqs)] for i in range(num_requests)]
    for e, lora in ((merged_engine, None), (lora_engine, reqs)):  # warm-up: kernels, allocator, adapter loads
        run_system(e, prompts[:len(reqs)], lora or [None] * len(reqs), 4, len(reqs))
    systems = {"merged": run_system(merged_engine, prompts, [None] * num_requests, max_tokens, concurrency),
               "multi-lora": run_system(lora_engine, prompts, mixed, max_tokens, concurrency),
               "lora-engine, base rows": run_system(lora_engine, prompts, [None] * num_requests, max_tokens,
                                                    concurrency)}
    ref, rows = systems["merged"], []
    want = ref["outputs"]
    on_adapter0 = [i for i in range(num_requests) if mixed[i] is reqs[0]]  # the adapter `merged` merges
    for name, r in systems.items():
        r.update(system=name, ratio=round(r["tok_s"] / ref["tok_s"], 3))
        if name == "multi-lora":
            r["adapter0_identical"] = all(r["outputs"][i] == want[i] for i in on_adapter0)
        del r["outputs"]
        rows.append(r)
    return dict(rows=rows, base=str(base), adapters=[str(p) for p in adapters], merged=str(merged), dtype=dtype,
                num_requests=num_requests, prompt_len=prompt_len, max_tokens=max_tokens, concurrency=concurrency,
                lora_stats={k: v for k, v in lora_engine.stats().items() if k.startswith("lora_")})


def to_markdown(report: dict[str, Any]) -> str:
    p = report["provenance"]
    lines = [f"# Multi-LoRA vs the merged model ({p['date']}, {p['threads']} thread(s), {report['dtype']})", "",
             f"Base `{report['base']}`, {len(report['adapters'])} adapters (rank {report['rank']}, every linear), "
             f"{report['num_requests']} requests of {report['prompt_len']} prompt + {report['max_tokens']} greedy "
             f"tokens, {report['concurrency']} at a time. Load average {p['load_average']} before, "
             f"{report['load_average_after']} after: a busy machine unless it says ~0.", "",
             "| system | tok/s | vs merged | adapter-0 tokens = merged |", "| --- | --- | --- | --- |"]
    for r in report["rows"]:
        same = {True: "yes", False: "NO"}.get(r.get("adapter0_identical"), "")
        lines.append(f"| {r['system']} | {r['tok_s']:.1f} | {r['ratio']:.2f}x | {same} |")
    lines += ["", f"LoRA engine counters: {report['lora_stats']}", "", f"Command: `{report['command']}`"]
    return "\n".join(lines) + "\n"


def main(
    model: Annotated[Optional[Path], typer.Option(help="Base model dir (default: a random ~30M Llama).")] = None,
    adapters: Annotated[int, typer.Option(help="Adapters mixed in the workload (all resident).")] = 4,
    rank: Annotated[int, typer.Option(help="Rank of every adapter.")] = 8,
    num_requests: Annotated[int, typer.Option(help="Requests in the workload.")] = 32,
    prompt_len: Annotated[int, typer.Option(help="Prompt tokens per request.")] = 64,
    max_tokens: Annotated[int, typer.Option(help="Greedy tokens per request.")] = 64,
    concurrency: Annotated[int, typer.Option(help="Requests in flight.")] = 16,
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16.")] = "bfloat16",
    threads: Annotated[int, typer.Option(help="torch intra-op threads.")] = 1,
    seed: Annotated[int, typer.Option(help="Workload seed.")] = 0,
    out: Annotated[Optional[Path], typer.Option(help="Write lora.json and .md here.")] = None,
) -> None:
    """Multi-LoRA (--adapters mixed in one workload) vs the merged model alone: tok/s and the ratio."""
    torch.set_num_threads(threads)
    work = out or Path("runs/bench-lora")
    work.mkdir(parents=True, exist_ok=True)
    base = model or random_model(work)
    # LMFORGE_SHORT (CI): 4 requests of 16 + 8 tokens, 2 at once, on the short random model
    num_requests, prompt_len, max_tokens = shrink(num_requests, 4), shrink(prompt_len, 16), shrink(max_tokens, 8)
    concurrency = shrink(concurrency, 2)
    paths = make_adapters(base, work, adapters, rank)
    report = dict(provenance=provenance(dtype), rank=rank)
    report.update(bench_run(base, paths, work / f"merged-r{rank}-0", rank, dtype, num_requests, prompt_len,
                            max_tokens, concurrency, seed))
    report["load_average_after"] = loadavg()
    report["command"] = "python -m lmforge.bench.lora " + " ".join(sys.argv[1:])
    emit(report, to_markdown, out, "lora")


if __name__ == "__main__":
    typer.run(main)
