"""Time to first token by prompt length over HTTP, against any OpenAI-compatible server (issue 25): for
each length, `--repeats` streamed `/v1/completions` requests of a fresh random prompt (different from
its first word on, so no prefix cache helps either server) with `max_tokens` 1, one at a time, each on
a new connection; the prompt's token count is the server's own (`usage.prompt_tokens` of one more,
unstreamed call). `lmforge bench serve --against` measures whole workloads; this says where in the
prompt lengths one server leads. Writes OUT.json and OUT.md.

    python scripts/ttft_by_length.py http://127.0.0.1:8000 --out runs/ttft/lmforge-bf16
"""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path
from typing import Annotated

import httpx
import typer

WORDS = "the quick brown fox jumps over a lazy dog while seven bright stars watch river mountain".split()


def main(url: Annotated[str, typer.Argument(help="Base URL, e.g. http://127.0.0.1:8000")],
         out: Annotated[Path, typer.Option(help="Writes OUT.json and OUT.md.")],
         model: str = "m", words: str = "16,64,128,256", repeats: int = 3) -> None:
    from lmforge.bench.report import provenance

    rows = []
    for n in (int(x) for x in words.split(",")):
        ms = []
        for r in range(repeats):
            rng = random.Random(n * 1000 + r)
            prompt = " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(n // 2))
            body = {"model": model, "prompt": prompt, "max_tokens": 1, "stream": True, "temperature": 0}
            with httpx.Client(timeout=600) as client:
                t0, first = time.perf_counter(), None
                with client.stream("POST", url + "/v1/completions", json=body) as resp:
                    resp.raise_for_status()
                    for line in resp.iter_lines():
                        if first is None and line.startswith("data:") and "[DONE]" not in line:
                            first = time.perf_counter() - t0
            if first is None:
                raise SystemExit(f"{url}: no streamed chunk for a {n}-word prompt")
            ms.append(1000 * first)
        usage = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1},
                           timeout=600).json()["usage"]
        rows.append({"words": n, "prompt_tokens": usage["prompt_tokens"], "ttft_ms": ms, "median_ms": statistics.median(ms)})
        print(f"{usage['prompt_tokens']} tokens: TTFT median {rows[-1]['median_ms']:.0f} ms "
              f"({', '.join(f'{x:.0f}' for x in ms)})", flush=True)
    rep = {"url": url, "model": model, "repeats": repeats, "rows": rows, "provenance": provenance("n/a")}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(rep, indent=2))
    tmp.replace(out.with_suffix(".json"))
    p = rep["provenance"]
    lines = [f"# TTFT by prompt length: {url}", "", f"{p['machine']}; load before {p['load_average']}; {p['date']}", "",
             "| prompt tokens | TTFT median (ms) | each (ms) |", "| ---: | ---: | --- |"]
    lines += [f"| {r['prompt_tokens']} | {r['median_ms']:.0f} | {', '.join(f'{x:.0f}' for x in r['ttft_ms'])} |"
              for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    typer.run(main)
