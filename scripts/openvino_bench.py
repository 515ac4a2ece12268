"""OpenVINO GenAI's side of `scripts/vs_openvino.py`: run in the benchmark-only environment
(`make openvino-env`: .venv-openvino), never in lmforge's. Imports nothing from lmforge.

    .venv-openvino/bin/python scripts/openvino_bench.py MODEL_DIR PROMPTS_JSON --threads 2

MODEL_DIR is an optimum-intel export (`optimum-cli export openvino ...`); PROMPTS_JSON is the token-id
prompts vs_openvino.py writes (the same ids lmforge and llama.cpp get):

    {"prefill": [[ids] per repeat], "depth": {"128": [[ids] per repeat], ...}, "decode_tokens": 128,
     "batch": [[[ids] x requests] per repeat], "batch_output": 128, "concurrency": 16}

Everything at OpenVINO's defaults but the thread count (`INFERENCE_NUM_THREADS`) and, for the batch
cell, `SchedulerConfig.max_num_seqs` (the requests in flight):

* prefill: `LLMPipeline.generate` on each prefill prompt with `max_new_tokens=1`; tok/s = prompt
  length / wall time (best of the repeats);
* decode at depth D: a D-token prompt, `decode_tokens + 1` new tokens (`ignore_eos`, greedy); tok/s
  = 1000 / its `perf_metrics.get_tpot()` mean (the tokens after the first);
* batch: `ContinuousBatchingPipeline.generate` on all the requests at once (`max_num_seqs` =
  concurrency), each `batch_output` tokens; output tok/s = requests x batch_output / wall time.

Prints one line `RESULT {json}` last: the figures, OpenVINO's version and the CPU plugin's settings
(inference precision, KV cache precision, dynamic quantization group size, capabilities).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import openvino as ov
import openvino_genai as ov_genai


def _tensor(ids: list[int]) -> ov.Tensor:
    return ov.Tensor(np.asarray([ids], dtype=np.int64))


def _config(new_tokens: int) -> ov_genai.GenerationConfig:
    cfg = ov_genai.GenerationConfig()
    cfg.max_new_tokens = new_tokens
    cfg.min_new_tokens = new_tokens
    cfg.ignore_eos = True
    cfg.do_sample = False
    return cfg


def plugin_info(threads: int) -> dict:
    core = ov.Core()
    info = {"openvino": ov.__version__, "openvino_genai": ov_genai.__version__, "threads": threads}
    for key in ("FULL_DEVICE_NAME", "OPTIMIZATION_CAPABILITIES", "INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION",
                "KEY_CACHE_PRECISION", "VALUE_CACHE_PRECISION", "KEY_CACHE_GROUP_SIZE", "VALUE_CACHE_GROUP_SIZE",
                "DYNAMIC_QUANTIZATION_GROUP_SIZE", "PERFORMANCE_HINT"):
        try:
            v = core.get_property("CPU", key)
            info[key.lower()] = v if isinstance(v, (int, float, str, list)) else str(v)
        except Exception as e:  # a key an older plugin lacks
            info[key.lower()] = f"unavailable: {str(e)[:80]}"
    return info


def single(model: Path, prompts: dict, threads: int) -> dict:
    pipe = ov_genai.LLMPipeline(str(model), "CPU", INFERENCE_NUM_THREADS=threads)
    n_dec = int(prompts["decode_tokens"])
    warm = prompts["warmup"]  # prompts of their own: a timed prompt warmed up would be cached
    pipe.generate(_tensor(warm["prefill"]), _config(1))  # warm-up: the prefill shapes compiled
    pipe.generate(_tensor(warm["prefill"][:16]), _config(8))
    prefill = []
    for ids in prompts["prefill"]:
        t0 = time.perf_counter()
        pipe.generate(_tensor(ids), _config(1))
        prefill.append(len(ids) / (time.perf_counter() - t0))
    res = {"prefill_tok_s": max(prefill), "prefill_all": prefill, "prefill_tokens": len(prompts["prefill"][0])}
    for depth, runs in prompts["depth"].items():
        rates = []
        for ids in runs:
            out = pipe.generate(_tensor(ids), _config(n_dec + 1))
            assert len(out.tokens[0]) == n_dec + 1, len(out.tokens[0])
            rates.append(1000.0 / out.perf_metrics.get_tpot().mean)
        res[f"decode_d{depth}_tok_s"] = max(rates)
        res[f"decode_d{depth}_all"] = rates
    del pipe
    return res


def batch(model: Path, prompts: dict, threads: int) -> dict:
    sched = ov_genai.SchedulerConfig()
    sched.max_num_seqs = int(prompts["concurrency"])
    pipe = ov_genai.ContinuousBatchingPipeline(str(model), sched, "CPU", {"INFERENCE_NUM_THREADS": threads})
    n_out = int(prompts["batch_output"])
    warm = prompts["warmup"]["batch"]
    pipe.generate([_tensor(ids[:16]) for ids in warm], [_config(4)] * len(warm))  # warm-up
    rates = []
    for reqs in prompts["batch"]:
        t0 = time.perf_counter()
        outs = pipe.generate([_tensor(ids) for ids in reqs], [_config(n_out)] * len(reqs))
        dt = time.perf_counter() - t0
        made = sum(len(o.m_generation_ids[0]) for o in outs)
        assert made == n_out * len(reqs), made
        rates.append(made / dt)
    return {"batch_tok_s": max(rates), "batch_all": rates, "scheduler": sched.to_string().split("\n"),
            "requests": len(prompts["batch"][0]), "concurrency": int(prompts["concurrency"]),
            "batch_prompt": len(prompts["batch"][0][0]), "batch_output": n_out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("prompts", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cells", default="single,batch", help="single (prefill + decode) and/or batch")
    args = ap.parse_args()
    prompts = json.loads(args.prompts.read_text())
    cells = set(args.cells.split(","))
    res = {"plugin": plugin_info(args.threads), "model": str(args.model)}
    qc = args.model / "openvino_config.json"
    if qc.is_file():
        res["export_config"] = json.loads(qc.read_text())
    if "single" in cells:
        res.update(single(args.model, prompts, args.threads))
    if "batch" in cells:
        res.update(batch(args.model, prompts, args.threads))
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    sys.exit(main())
