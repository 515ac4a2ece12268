"""Where one decode step's milliseconds go, batch 1 (issue 25, item 2).

The engine runs `--steps` greedy decode steps of one request on MODEL (an HF folder or a GGUF file);
the linear layers' kernel calls (`QmmLinear` / `PackedLinear` / `nn.Linear`) and the attention
backend's calls are timed with `perf_counter` around each call (the timers cost ~0.3 us a call), the
engine's own phases come from `LLMEngine.step_profile()`. What remains of the model's forward after
the linear and attention calls is the Python module tree and its small torch ops (embedding, RMSNorm,
RoPE, residual adds, reshapes): the interpreter's share of a step.

    python scripts/decode_step_profile.py runs/vs-llamacpp/random-llama-300m/model-q4_0.gguf --quant-activations int8
    python scripts/decode_step_profile.py runs/vs-llamacpp/random-llama-300m --dtype float32   # the float32 C layers
    python scripts/decode_step_profile.py MODEL-q4_0.gguf --quant-activations int8 --prompt-len 600  # at long context
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Annotated, Optional

import torch
import typer
from torch import nn

from lmforge.engine import LLM, SamplingParams


def timed(obj, attr: str, acc: dict, key: str) -> None:
    """Wrap obj.attr (an instance's method, or a class's for every instance) so that each call adds its seconds to
    acc[key] and one to acc[key + "_calls"] (also `scripts/prefill_breakdown.py`'s)."""
    fn = getattr(obj, attr)

    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[key] += time.perf_counter() - t
            acc[key + "_calls"] += 1
    setattr(obj, attr, wrapper)


def profile(model: str, quant_activations: str = "auto", threads: int = 2, steps: int = 128,
            dtype: str = "auto", prompt_len: int = 1) -> dict:
    torch.set_num_threads(threads)
    llm = LLM(model, dtype=dtype, enable_prefix_caching=False, quant_activations=quant_activations)
    eng = llm.llm_engine
    runner = eng.model_runner
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    prompt = [5 + i % 97 for i in range(prompt_len)]  # decode at prompt_len.. tokens of context
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    acc: dict = defaultdict(float)
    linears = [m for m in runner.model.modules()
               if type(m).__name__ in ("QmmLinear", "PackedLinear", "Int8Linear", "Int4Linear", "DequantLinear")
               or type(m) is nn.Linear]
    for m in linears:
        timed(m, "forward", acc, "linear")
    libs = {id(m.lib): m.lib for m in runner.model.modules() if type(m).__name__ == "CDecodeLayer"}
    for lib in libs.values():  # the decoder layers as C calls (engine.decode_layer): linears and attention inside
        timed(lib, "decode_layer_q", acc, "c_layer")  # a call a layer
        timed(lib, "decode_stack_q", acc, "c_layer")  # or the whole stack in one
    timed(runner.attn, "__call__", acc, "attention")

    # the steps one by one: the prefill step first, then the counters from zero for the `steps` decode steps
    eng.add_request("profile", prompt, params)
    eng.step()
    acc.clear()
    before = dict(eng.step_profile())
    t0 = time.perf_counter()
    done = []
    while eng.has_unfinished_requests():
        done += [o for o in eng.step() if o.finished]
    wall = time.perf_counter() - t0
    after = eng.step_profile()
    out = done[-1].outputs[0]
    n = steps
    phases = {k: 1000 * (after[k] - before.get(k, 0.0)) / n for k in after}
    tt = out.token_times
    step_ms = 1000 * (tt[-1] - tt[0]) / (len(tt) - 1)
    lin, att, c_layer = (1000 * acc[k] / n for k in ("linear", "attention", "c_layer"))
    rows = {"decoder layers as C calls (norms, matmuls, RoPE, K/V, attention, adds)": c_layer,
            "linear kernels (Python-called)": lin, "attention (Python-called: KV write + decode kernel)": att,
            "rest of the forward (Python modules, embedding, norms, RoPE, adds)": phases["forward"] - lin - att - c_layer,
            "prepare (inputs, attention metadata)": phases["prepare"], "sample": phases["sample"],
            "schedule + postprocess + detokenize": phases["schedule"] + phases["postprocess"] + phases["detokenize"]}
    rows = {k: v for k, v in rows.items() if v > 0.005 or "rest" in k}
    rows["between steps (generate loop, outputs)"] = step_ms - sum(rows.values())
    st = llm.stats()
    return {"model": model, "quant_activations": quant_activations, "threads": threads, "steps": steps,
            "prompt_len": prompt_len, "kv_cache_dtype": st.get("kv_cache_dtype"),
            "c_layers": runner.decode_layers, "c_layers_why_not": runner.decode_layers_why,
            "step_ms": step_ms, "tok_s": 1000 / step_ms, "wall_s": wall, "ms": rows,
            "linear_calls_per_step": acc["linear_calls"] / n, "weight_bytes": st.get("weight_bytes"),
            "linear_gb_s": (st.get("weight_bytes") or 0) / ((lin + c_layer) / 1000) / 1e9 if lin + c_layer else None,
            "linear_backend": st.get("linear_backend"), "dtype": st.get("dtype")}


def main(models: list[str],
         quant_activations: Annotated[str, typer.Option(help="auto (the engine's default), none or int8; applied to "
                                                             "every model (float ones run float whatever it says)")] = "auto",
         threads: int = 2, steps: int = 128,
         dtype: Annotated[str, typer.Option(help="auto, float32 or bfloat16 (LLM's dtype).")] = "auto",
         prompt_len: Annotated[int, typer.Option(help="Prompt tokens: the steps decode after this much context.")] = 1,
         out: Annotated[Optional[Path], typer.Option(help="Write decode_profile.json here.")] = None) -> None:
    reps = [profile(m, quant_activations, threads, steps, dtype, prompt_len) for m in models]
    for r in reps:
        print(f"\n{r['model']} ({r['dtype']}, K/V {r['kv_cache_dtype']}, {r['linear_backend']}), {r['threads']} threads, "
              f"context {r['prompt_len']}..{r['prompt_len'] + r['steps']}: "
              f"{r['step_ms']:.2f} ms a step ({r['tok_s']:.1f} tok/s), {r['linear_calls_per_step']:.0f} linear "
              f"calls a step (+ {r['c_layers']} C layers), weights read at {r['linear_gb_s']:.1f} GB/s "
              f"(all weight bytes / time in linear kernels and C layers)")
        for k, v in r["ms"].items():
            print(f"  {v:7.2f} ms  {100 * v / r['step_ms']:5.1f}%  {k}")
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "decode_profile.json").write_text(json.dumps(reps, indent=1))


if __name__ == "__main__":
    typer.run(main)
