"""Is the engine's growing RSS under load a leak or a high-water mark? (issue 43)

One `LLMEngine` in this process on the soak's model (a random Llama, hidden 128, 4 layers, `bench soak`'s
`--max-model-len 512`), rounds of 64 requests shaped as `lmforge bench soak`'s (completions "The city of N",
chats "Tell me about the river N", 32 greedy tokens each). Every 5 rounds: the process's RSS, and how many
KV blocks have ever been handed out (the pool is allocated with calloc's lazy zero pages, `kv_pool.lazy_zeros`:
a block costs resident memory only from its first use). A leak keeps growing once every block has been
used; a high-water mark stops there.

    python scripts/engine_rss_fill.py [--rounds 60] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import psutil
import torch

from lmforge.engine import EngineConfig, LLMEngine, SamplingParams
from lmforge.serve.testing import make_model_with_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--model", help="a model folder (default: the soak's tiny random Llama, built here)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="lmforge-rss-"))
    model = a.model or make_model_with_tokenizer(root / "v1", root / "tok", hidden_size=128, layers=4)
    engine = LLMEngine(EngineConfig(model=str(model), max_model_len=512))
    bm, touched = engine.block_manager, set()
    allocate = bm.allocate

    def counting(seq, n):  # every block id ever handed out
        before = len(seq.block_table)
        allocate(seq, n)
        touched.update(seq.block_table[before:])

    bm.allocate = counting
    per_block = engine.model_runner.attn.bytes_per_block
    print(json.dumps({"kv_blocks": bm.num_blocks, "kv_pool_mib": round(bm.num_blocks * per_block / 2**20, 1)}))
    proc, rng, tok = psutil.Process(), random.Random(0), engine.tokenizer
    rss0, t0, rid = proc.memory_info().rss, time.time(), 0
    for r in range(a.rounds):
        for i in range(64):
            chat = [{"role": "user", "content": f"Tell me about the river {rng.randrange(50)}"}]
            prompt = (f"The city of {rng.randrange(50)}" if i % 2 else
                      tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
            engine.add_request(str(rid), prompt, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
            rid += 1
        while engine.has_unfinished_requests():
            engine.step()
        if r % 5 == 0 or r == a.rounds - 1:
            rss = proc.memory_info().rss
            print(json.dumps({"round": r, "t_s": round(time.time() - t0, 1), "rss_mib": round(rss / 2**20, 1),
                              "growth_mib": round((rss - rss0) / 2**20, 1), "blocks_used_ever": len(touched),
                              "their_mib": round(len(touched) * per_block / 2**20, 1)}), flush=True)


if __name__ == "__main__":
    main()
