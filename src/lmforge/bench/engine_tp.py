"""Engine tensor parallelism, measured: offline generation tokens/s and all-reduced bytes per layer per
token at each `tensor_parallel_size`, on the same random model and requests.

    python -m lmforge.bench.engine_tp --sizes 1 2 4 --tp1-threads 1 2 --out runs/bench-tp

Each size gets a fresh `LLM` (workers included) with `max(1, cpus // N)` torch threads per rank (size 1:
`--tp1-threads`, each a run of its own, as one process on a busy box may do better with fewer); one
warm-up request runs before the clock starts. The model is `lmforge bench engine`'s random ~30M Llama
(hidden 512, 8 layers, 8 heads, MLP 1024) unless `--model` names another. The bytes come from rank 0's
`CommCounter` (every rank all-reduces the same tensors); `tokens_sha1` hashes every output's greedy
tokens, so equal hashes mean the sizes generated the same tokens. Knows nothing about serving.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch

from lmforge.bench.engine import random_model
from lmforge.engine.executor import threads_per_rank
from lmforge.engine.llm import LLM
from lmforge.engine.sampling_params import SamplingParams


def run_size(model_dir: str, size: int, num_requests: int, prompt_len: int, output_len: int, dtype: str,
             threads: int | None = None) -> dict:
    threads = threads_per_rank(size) if size > 1 or threads is None else threads
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    llm = LLM(model_dir, dtype=dtype, device="cpu", tensor_parallel_size=size)
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    vocab = llm.llm_engine.vocab_size
    prompts = [[(7 + 31 * i + 17 * j) % vocab for j in range(prompt_len)] for i in range(num_requests)]
    llm.generate([prompts[0][:8]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    executor = llm.llm_engine.executor
    if executor is not None:
        executor.counter.reset()
    before = llm.stats()["tokens_processed"]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = llm.stats()["tokens_processed"] - before
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    per_layer = executor.counter.per_layer() if executor is not None else {}
    result = dict(tensor_parallel_size=size, threads_per_rank=threads, load_s=round(load_s, 2),
                  wall_s=round(wall, 3), output_tok_s=round(out_tokens / wall, 1),
                  tokens_processed=tokens, total_tok_s=round(tokens / wall, 1),
                  allreduce_bytes_per_layer_per_token=(per_layer[0] / tokens if per_layer else 0),
                  tokens_sha1=hashlib.sha1(json.dumps([o.outputs[0].token_ids for o in outs]).encode()).hexdigest()[:12])
    llm.llm_engine.shutdown()
    return result


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--model", default=None, help="an HF layout directory (default: a random ~30M Llama under --out)")
    ap.add_argument("--out", default="runs/bench-tp")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tp1-threads", type=int, nargs="+", default=[None],
                    help="torch threads for size 1, one run each (default: every CPU); "
                         "size N > 1 gets cpus // N per rank")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        model_dir = str(random_model(out))
    else:
        model_dir = args.model
    results = []
    for size in args.sizes:
        for threads in args.tp1_threads if size == 1 else [None]:
            results.append(run_size(model_dir, size, args.num_requests, args.prompt_len, args.output_len, args.dtype,
                                    threads))
            print(json.dumps(results[-1]), flush=True)
    (out / "bench_tp.json").write_text(json.dumps(dict(model=model_dir, cpus=os.cpu_count(), load=os.getloadavg(),
                                                       results=results), indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
