"""Where a prefill's time goes: one `--length`-token prompt (random ids, one output token) through `LLM.generate` with
default flags, `--prompts` times, wall time split by wrapping the engine's pieces (the linears' `QmmLinear.forward` and
`forward_swiglu`, the down projection that takes SwiGLU's middle,
paged prefill attention, RMSNorm, RoPE, the K/V writes; "other" is the rest: the residual adds, the
embedding, the sampler, the Python between kernels). Means a prompt in ms, and the best prompt's tok/s (issue 44).
`LMFORGE_*` switches apply as usual, e.g. `LMFORGE_KV_PREFAULT=0` for the K/V writes without the pool's prefault.

    python scripts/prefill_breakdown.py runs/vs-openvino/random-llama-300m
"""

from __future__ import annotations

import collections
import random
import sys
import time
from pathlib import Path
from typing import Annotated

import torch
import typer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_step_profile import timed  # noqa: E402  the same call-timing wrapper


def main(model: Annotated[str, typer.Argument(help="HF folder or GGUF file.")], length: int = 512, prompts: int = 6,
         threads: int = 2, join_prefault: bool = typer.Option(False, help="Wait for the KV pool's prefault first.")) -> None:
    import lmforge.engine.attention.cpu_kernels as ck
    import lmforge.engine.attention.kv_pool as kp
    import lmforge.engine.fused as fused
    import lmforge.quant.linear as linear
    from lmforge.engine import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model)
    spent: collections.Counter = collections.Counter()
    for cls, name, key in ((linear.QmmLinear, "forward", "linears"), (linear.QmmLinear, "forward_swiglu", "linears"),
                           (ck.KernelBackend, "_prefill", "attention"),
                           (fused.FusedRMSNorm, "forward", "rmsnorm"), (fused.FusedAttention, "rope", "rope"),
                           (kp.KVPool, "write", "kv writes")):
        timed(cls, name, spent, key)
    prefault = llm.llm_engine.model_runner.attn.kv.prefault
    if join_prefault and prefault is not None:
        prefault.join()
    rng = random.Random(0)
    vocab = llm.llm_engine.model_runner.model.config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([[rng.randrange(3, vocab) for _ in range(length)]], params, use_tqdm=False)  # warm-up
    spent.clear()
    total, best = 0.0, float("inf")
    for _ in range(prompts):
        ids = [rng.randrange(3, vocab) for _ in range(length)]
        t = time.perf_counter()
        llm.generate([ids], params, use_tqdm=False)
        dt = time.perf_counter() - t
        total, best = total + dt, min(best, dt)
    print(f"{model}: best {length / best:.1f} tok/s, mean {total / prompts * 1e3:.1f} ms a prompt")
    secs = {k: v for k, v in spent.items() if not k.endswith("_calls")}
    for key, s in sorted(secs.items(), key=lambda kv: -kv[1]):
        print(f"  {key:10s} {s / prompts * 1e3:7.1f} ms")
    print(f"  {'other':10s} {(total - sum(secs.values())) / prompts * 1e3:7.1f} ms")


if __name__ == "__main__":
    typer.run(main)
