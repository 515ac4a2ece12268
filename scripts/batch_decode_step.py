"""Milliseconds a decode step with several sequences at once (the decode half of `scripts/vs_openvino.py`'s batch
cell), through `LLM.generate` with default flags, against the same engine built under `--env VAR=VALUE` (e.g.
`LMFORGE_BF16_PANELS=0`), the two alternating in one process so that the VM's drift hits both alike (issue 44).

Each round: `--seqs` fresh prompts of `--prompt-len` random token ids are prefilled once (one output token) so
that the timed call finds them in the prefix cache, then generated again for `--tokens` + 1 tokens; the figure is
that call's wall time / `--tokens` (a step's prefill of the last prompt token included, ~1 step in 128).

    python scripts/batch_decode_step.py runs/vs-openvino/random-llama-300m --env LMFORGE_BF16_PANELS=0
    python scripts/batch_decode_step.py runs/vs-openvino/gguf/random-llama-300m-q8_0.gguf --env LMFORGE_A8_PANELS=1
"""

from __future__ import annotations

import os
import random
import time
from typing import Annotated, Optional

import torch
import typer


def main(model: Annotated[str, typer.Argument(help="HF folder or GGUF file.")],
         env: Annotated[Optional[str], typer.Option(help="VAR=VALUE for a second engine to alternate with.")] = None,
         seqs: int = 16, prompt_len: int = 128, tokens: int = 128, repeats: int = 2, threads: int = 2) -> None:
    from lmforge.engine import LLM, SamplingParams

    torch.set_num_threads(threads)
    engines = {"defaults": LLM(model)}
    if env is not None:
        var, _, value = env.partition("=")
        before = os.environ.get(var)
        os.environ[var] = value
        try:
            engines[env] = LLM(model)
        finally:
            if before is None:
                del os.environ[var]
            else:
                os.environ[var] = before
    rng = random.Random(0)
    vocab = min(e.llm_engine.model_runner.model.config.vocab_size for e in engines.values())
    params = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    best = dict.fromkeys(engines, float("inf"))
    for _ in range(repeats):
        for name, llm in engines.items():
            prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(seqs)]
            llm.generate(prompts, params(1), use_tqdm=False)
            t = time.perf_counter()
            llm.generate(prompts, params(tokens + 1), use_tqdm=False)
            best[name] = min(best[name], (time.perf_counter() - t) / tokens)
    for name, llm in engines.items():
        print(f"{name}: {best[name] * 1e3:.1f} ms a step of {seqs} sequences ({seqs / best[name]:.1f} tok/s); "
              f"{llm.stats()['linear_backend']}", flush=True)


if __name__ == "__main__":
    typer.run(main)
