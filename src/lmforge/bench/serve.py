"""`lmforge bench serve`: load-test an OpenAI-compatible server the way users hit it.

Streams `/v1/completions` requests (token-id prompts, `ignore_eos` + `max_tokens`, so prompt and
output lengths are exactly the workload's) with Poisson arrivals at `request_rate` (or all at
once), at most `max_concurrency` in flight. Measures on the client: TTFT, TPOT = (e2e - TTFT) /
(output tokens - 1), ITL (gaps between streamed chunks), E2E (mean, p50, p90, p99), request and
token throughput, failures, and goodput (requests/s that meet every SLO). Beside it, the server's
own view: the deltas of its `/metrics` counters and histogram means over the run. With
`offline_model`, the same requests also run through the offline `LLM` (same batch size), to
price the HTTP layer. Writes `bench.json` and `bench.md` to `out`.

Workloads are generated from a seed (the same run twice sends the same requests):
  high-variance  prompt 16-512, output 8-512 tokens, log-uniform
  uniform        every request `input_len` prompt and `output_len` output tokens (vLLM's `random`
                 dataset, also by that name; `range_ratio` r draws each length from [len(1-r), len(1+r)])
  shared-prefix  like uniform, but the first 3/4 of every prompt is one shared prefix
  sharegpt       vLLM's ShareGPT sampling from `dataset_path` (a ShareGPT JSON): each conversation's
                 first human turn is the prompt, its first reply's token count the output length
                 (counted with `tokenizer`); pairs with a prompt or reply under 4 tokens, a prompt over
                 1024 or both over 2048 tokens are skipped, as vLLM skips them
Prompt ids are drawn from [5, 261): the byte tokens of a byte-level BPE after lmforge's five
specials, valid ids for any vocabulary of at least 261 (ShareGPT prompts go as text). Clipped so
prompt + output fit the server's `max_model_len`. `ignore_eos` (the default, vLLM's `--ignore-eos`)
makes every output exactly its length. This module knows nothing about the engine (except for the
offline comparison) and imports no torch unless asked for it.

    lmforge bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8 --out runs/bench
    lmforge bench serve --host 127.0.0.1 --port 8000 --dataset-name random --random-input-len 256 \
        --random-output-len 64 --ignore-eos --save-result --result-dir runs/bench       # vLLM's names

With `--against URL` (`bench_against`) the same requests go, one concurrency at a time (1 and 16 by
default), to lmforge's server and to any other OpenAI-compatible server (llama.cpp's `llama-server`,
vLLM, Ollama's /v1): output tok/s and TTFT per server and concurrency, their ratios, and the machine
with its load average, in one report. A server that sends no stream usage is counted one token a
chunk (llama-server streams a token a chunk).

    lmforge bench serve --base-url http://127.0.0.1:8000 --against http://127.0.0.1:8080 \
        --concurrency 1,16 --num-prompts 32 --out runs/vs-llamacpp
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from lmforge.engine import LLM, SamplingParams
from lmforge.track.io import atomic_write_json, atomic_write_text
from lmforge.track.progress import Progress
from lmforge.track.provenance import hardware_info, package_versions

WORKLOADS = ("high-variance", "uniform", "random", "shared-prefix", "sharegpt")
TOKEN_LO, TOKEN_HI = 5, 261
SHAREGPT_MIN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048  # vLLM's pruning of ShareGPT pairs


@dataclass
class BenchConfig:
    base_url: str
    model: str | None = None  # None = the first model of /v1/models
    num_prompts: int = 100
    request_rate: float = math.inf  # requests/s, Poisson arrivals; inf = all at once
    max_concurrency: int | None = None
    workload: str = "high-variance"
    input_len: int = 128  # uniform and shared-prefix
    output_len: int = 128
    seed: int = 0
    slo: dict[str, float] = field(default_factory=dict)  # ttft / tpot / itl / e2e -> milliseconds
    api_key: str | None = None
    offline_model: str | None = None
    offline_dtype: str = "auto"
    progress: bool = True
    ignore_eos: bool = True  # every output runs to output_len (vLLM's --ignore-eos)
    range_ratio: float = 0.0  # uniform/random: lengths drawn from [len * (1 - r), len * (1 + r)]
    dataset_path: str | None = None  # sharegpt: the ShareGPT JSON file
    tokenizer: str | None = None  # sharegpt: the folder whose tokenizer counts prompt and reply tokens

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload {self.workload!r} (--workload / --dataset-name): choose one of "
                             f"{', '.join(WORKLOADS)}")
        if self.num_prompts < 1 or self.request_rate <= 0 or (self.max_concurrency or 1) < 1:
            raise ValueError("num_prompts, request_rate and max_concurrency must be positive")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"--random-range-ratio {self.range_ratio}: must be in [0, 1)")
        if (self.workload == "sharegpt") != (self.dataset_path is not None):
            raise ValueError("--dataset-name sharegpt goes with --dataset-path FILE (a ShareGPT JSON), and only it")
        if self.workload == "sharegpt" and not self.tokenizer:
            raise ValueError("--dataset-name sharegpt needs --tokenizer DIR (a model folder) to count the "
                             "prompt and reply tokens, as vLLM does")
        bad = set(self.slo) - {"ttft", "tpot", "itl", "e2e"}
        if bad:
            raise ValueError(f"--slo: unknown metric(s) {sorted(bad)}; use ttft, tpot, itl, e2e (milliseconds)")


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=500,tpot=50' or 'ttft=0.5s,tpot=50ms' -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    out: dict[str, float] = {}
    for part in filter(None, (text or "").split(",")):
        key, _, value = part.partition("=")
        value = value.strip().lower()
        scale = 1000.0 if value.endswith("s") and not value.endswith("ms") else 1.0
        try:
            out[key.strip()] = float(value.removesuffix("ms").removesuffix("s")) * scale
        except ValueError:
            raise ValueError(f"--slo {text!r}: {part!r} is not NAME=MILLISECONDS") from None
    return out


@dataclass
class BenchRequest:
    prompt: list[int] | str  # token ids; text for ShareGPT
    output_len: int
    prompt_len: int = 0  # tokens of a text prompt (counted with the tokenizer); ids: their number

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str):
            self.prompt_len = len(self.prompt)


def make_workload(cfg: BenchConfig, max_model_len: int) -> list[BenchRequest]:
    if cfg.workload == "sharegpt":
        return sharegpt_requests(Path(cfg.dataset_path), cfg.tokenizer, cfg.num_prompts, cfg.seed, max_model_len)
    rng = random.Random(cfg.seed)

    def spread(n: int) -> int:  # vLLM's --random-range-ratio
        return rng.randint(max(1, int(n * (1 - cfg.range_ratio))), int(n * (1 + cfg.range_ratio))) \
            if cfg.range_ratio else n

    def log_uniform(lo: int, hi: int) -> int:
        return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))

    def tokens(n: int) -> list[int]:
        return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]

    prefix = tokens(cfg.input_len * 3 // 4)
    reqs = []
    for _ in range(cfg.num_prompts):
        if cfg.workload == "high-variance":
            p, o = tokens(log_uniform(16, 512)), log_uniform(8, 512)
        elif cfg.workload in ("uniform", "random"):
            p, o = tokens(spread(cfg.input_len)), spread(cfg.output_len)
        else:
            p, o = prefix + tokens(cfg.input_len - len(prefix)), cfg.output_len
        o = max(1, min(o, max_model_len - 1))
        reqs.append(BenchRequest(p[: max_model_len - o], o))
    return reqs


def sharegpt_requests(path: Path, tokenizer_dir: str, n: int, seed: int, max_model_len: int) -> list[BenchRequest]:
    """`n` (prompt, output length) pairs sampled from a ShareGPT JSON as vLLM samples them (see the module
    docstring); ValueError naming the file when it is not ShareGPT or holds too few usable pairs."""
    from transformers import AutoTokenizer  # deferred: only the ShareGPT workload counts tokens

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"--dataset-path {path}: {type(e).__name__}: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: a ShareGPT file is a JSON list of {{\"conversations\": [...]}}")
    pairs = [(c[0]["value"], c[1]["value"]) for d in data if isinstance(d, dict)
             and isinstance(c := d.get("conversations"), list) and len(c) >= 2
             and all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in c[:2])]
    random.Random(seed).shuffle(pairs)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    out = []
    for prompt, reply in pairs:
        p, o = len(tok(prompt).input_ids), len(tok(reply).input_ids)
        if p < SHAREGPT_MIN or o < SHAREGPT_MIN or p > SHAREGPT_MAX_PROMPT or p + o > SHAREGPT_MAX_TOTAL \
                or p + o > max_model_len:
            continue
        out.append(BenchRequest(prompt, o, p))
        if len(out) == n:
            return out
    raise ValueError(f"--dataset-path {path}: {len(out)} usable conversations for --num-prompts {n} (of "
                     f"{len(pairs)} with a prompt and a reply; each must fit {max_model_len} tokens)")


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def _one(client: httpx.AsyncClient, cfg: BenchConfig, model: str, req: BenchRequest) -> RequestResult:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
            "ignore_eos": cfg.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    res, last = RequestResult(ok=False), None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return RequestResult(ok=False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return RequestResult(ok=False, error=chunk["error"].get("message", "stream error"))
                now = time.perf_counter()
                if chunk.get("choices"):
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
        res.e2e = time.perf_counter() - start
        res.ok = last is not None
        if res.ok and not res.output_tokens:  # a server without stream usage: one token a chunk (llama-server)
            res.prompt_tokens, res.output_tokens = req.prompt_len, len(res.itl) + 1
        if not res.ok:
            res.error = "the stream ended without a token"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """mean, p50, p90, p99 (linear interpolation, as numpy's default), in ms by default."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    v = sorted(values)

    def pct(q: float) -> float:
        k = (len(v) - 1) * q
        lo, hi = math.floor(k), math.ceil(k)
        return v[lo] + (v[hi] - v[lo]) * (k - lo)

    return {"mean": scale * sum(v) / len(v), "p50": scale * pct(0.5), "p90": scale * pct(0.9),
            "p99": scale * pct(0.99)}


def _meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    got = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2e": r.e2e, "itl": max(r.itl, default=0.0)}
    return r.ok and all(got[k] * 1000 <= v for k, v in slo.items())


# ---- the server's view -------------------------------------------------------------------------------

SERVER_COUNTERS = ("vllm:request_success", "vllm:prompt_tokens", "vllm:generation_tokens",
                   "vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
SERVER_HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                     "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds")


def scrape(client: httpx.Client, model: str) -> dict[str, float]:
    """Counter totals and histogram sums/counts from /metrics, for `model`'s label only."""
    r = client.get("/metrics")
    out: dict[str, float] = {}
    if r.status_code != 200 or "vllm:" not in r.text:  # a server without vLLM's metrics (llama-server)
        return out
    text = r.text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels.get("model_name", model) != model:
                continue
            if fam.name in SERVER_COUNTERS and s.name.endswith("_total"):
                out[fam.name] = out.get(fam.name, 0.0) + s.value
            elif fam.name in SERVER_HISTOGRAMS and s.name.endswith(("_sum", "_count")):
                out[s.name] = out.get(s.name, 0.0) + s.value  # summed over model versions
            elif fam.name == "vllm:kv_cache_usage_perc":
                out[fam.name] = max(out.get(fam.name, 0.0), s.value)
    return out


def server_view(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    view = {"requests": d.get("vllm:request_success", 0.0), "prompt_tokens": d.get("vllm:prompt_tokens", 0.0),
            "generation_tokens": d.get("vllm:generation_tokens", 0.0),
            "preemptions": d.get("vllm:num_preemptions", 0.0),
            "prefix_cache_hit_rate": (d.get("vllm:prefix_cache_hits", 0.0) / d["vllm:prefix_cache_queries"]
                                      if d.get("vllm:prefix_cache_queries") else 0.0)}
    for h, short in zip(SERVER_HISTOGRAMS, ("ttft", "itl", "e2e", "queue_time")):
        n = d.get(h + "_count", 0.0)
        view[f"mean_{short}_ms"] = 1000 * d.get(h + "_sum", 0.0) / n if n else 0.0
    return view


# ---- the run -----------------------------------------------------------------------------------------


async def _run_requests(cfg: BenchConfig, model: str, reqs: list[BenchRequest]) -> tuple[list[RequestResult], float]:
    limit = cfg.max_concurrency or len(reqs)
    sem = asyncio.Semaphore(limit)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    with Progress("bench serve", total=len(reqs), unit="req", enabled=cfg.progress, heartbeat=True) as progress:
        return await _send_all(cfg, model, reqs, sem, progress, httpx.AsyncClient(
            base_url=cfg.base_url, headers=headers, timeout=httpx.Timeout(600.0), limits=limits))


async def _send_all(cfg: BenchConfig, model: str, reqs: list[BenchRequest], sem: asyncio.Semaphore,
                    progress: Progress, client: httpx.AsyncClient) -> tuple[list[RequestResult], float]:
    """Every request, arriving at `cfg.request_rate` (Poisson) or all at once; at most `sem` in flight."""
    rng = random.Random(cfg.seed + 1)
    async with client:

        async def run(req: BenchRequest) -> RequestResult:
            async with sem:
                r = await _one(client, cfg, model, req)
            progress.advance()
            return r

        start, tasks = time.perf_counter(), []
        for req in reqs:
            tasks.append(asyncio.ensure_future(run(req)))
            if math.isfinite(cfg.request_rate):
                await asyncio.sleep(rng.expovariate(cfg.request_rate))  # Poisson process: exponential gaps
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return list(results), duration


def summarize(cfg: BenchConfig, results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    summary = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "prompt_tokens": prompt_tokens, "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (prompt_tokens + out_tokens) / duration,
        "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _stats([x for r in ok for x in r.itl]), "e2e_ms": _stats([r.e2e for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    if cfg.slo:
        good = sum(_meets_slo(r, cfg.slo) for r in results)
        summary["goodput"] = good / duration
        summary["slo_attainment"] = good / len(results)
    return summary


def run_offline(cfg: BenchConfig, reqs: list[BenchRequest]) -> dict[str, float]:
    """The same requests through the offline engine, batch size = max_concurrency (the server's
    load), so the two throughputs price the HTTP layer and nothing else."""
    llm = LLM(cfg.offline_model, dtype=cfg.offline_dtype, max_num_seqs=cfg.max_concurrency or 128)
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
    llm.generate([reqs[0].prompt], params[:1], use_tqdm=False)  # warm-up, as the server is warm
    start = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params, use_tqdm=False)
    duration = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"duration_s": duration, "output_tokens": tokens, "output_throughput": tokens / duration}


def bench_serve(cfg: BenchConfig, out: Path | None = None, json_name: str = "bench.json") -> dict[str, Any]:
    """Run the benchmark; return (and write, with `out`, as `json_name` and a Markdown twin) the report."""
    with httpx.Client(base_url=cfg.base_url, timeout=30.0,
                      headers={"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}) as c:
        card = c.get("/v1/models").raise_for_status().json()["data"][0]
        model = cfg.model or card["id"]
        reqs = make_workload(cfg, int(card.get("max_model_len") or 2048))
        before = scrape(c, model)
        results, duration = asyncio.run(_run_requests(cfg, model, reqs))
        after = scrape(c, model)
    report: dict[str, Any] = {"config": {**asdict(cfg), "model": model}, "client": summarize(cfg, results, duration),
                              "server": server_view(before, after)}
    if cfg.offline_model:
        report["offline"] = run_offline(cfg, reqs)
        report["offline"]["http_over_offline"] = report["client"]["output_throughput"] / report["offline"][
            "output_throughput"]

    report["provenance"] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "packages": package_versions(),
                            "hardware": hardware_info()}
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(out) / json_name, report)
        atomic_write_text((Path(out) / json_name).with_suffix(".md"), to_markdown(report))
    return report


def to_markdown(report: dict[str, Any]) -> str:
    cfg, c, s = report["config"], report["client"], report["server"]
    rate = "all at once" if not math.isfinite(cfg["request_rate"]) else f"{cfg['request_rate']:g} req/s"
    lines = [f"# bench serve: {cfg['model']} at {cfg['base_url']}", "",
             f"{cfg['num_prompts']} requests, workload `{cfg['workload']}`, {rate}, "
             f"max concurrency {cfg['max_concurrency'] or 'unlimited'}, seed {cfg['seed']}; "
             f"{report['provenance']['date']}", "",
             "| | value |", "| --- | --- |",
             f"| completed / failed | {c['completed']} / {c['failed']} |",
             f"| duration | {c['duration_s']:.2f} s |",
             f"| prompt / output tokens | {c['prompt_tokens']} / {c['output_tokens']} |",
             f"| request throughput | {c['request_throughput']:.2f} req/s |",
             f"| output token throughput | {c['output_throughput']:.1f} tok/s |",
             f"| total token throughput | {c['total_token_throughput']:.1f} tok/s |"]
    if "goodput" in c:
        lines.append(f"| goodput ({', '.join(f'{k}<={v:g}ms' for k, v in cfg['slo'].items())}) | "
                     f"{c['goodput']:.2f} req/s ({100 * c['slo_attainment']:.0f}% of requests) |")
    if "offline" in report:
        o = report["offline"]
        lines.append(f"| offline engine, same requests | {o['output_throughput']:.1f} tok/s "
                     f"(HTTP/offline = {100 * o['http_over_offline']:.0f}%) |")
    lines += ["", "| latency (ms) | mean | p50 | p90 | p99 |", "| --- | --- | --- | --- | --- |"]
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        v = c[k]
        lines.append(f"| {k[:-3].upper()} | {v['mean']:.1f} | {v['p50']:.1f} | {v['p90']:.1f} | {v['p99']:.1f} |")
    lines += ["", "Server's view (/metrics deltas over the run):", "", "| | value |", "| --- | --- |",
              f"| requests finished | {s['requests']:.0f} |",
              f"| prompt / generation tokens | {s['prompt_tokens']:.0f} / {s['generation_tokens']:.0f} |",
              f"| preemptions | {s['preemptions']:.0f} |",
              f"| prefix-cache hit rate | {100 * s['prefix_cache_hit_rate']:.1f}% |",
              f"| mean TTFT / ITL / E2E / queue | {s['mean_ttft_ms']:.1f} / {s['mean_itl_ms']:.1f} / "
              f"{s['mean_e2e_ms']:.1f} / {s['mean_queue_time_ms']:.1f} ms |"]
    if c["errors"]:
        lines += ["", "Errors (first 5 distinct):", ""] + [f"- {e}" for e in c["errors"]]
    return "\n".join(lines) + "\n"


# ---- lmforge against another OpenAI-compatible server ------------------------------------------------


def _first_model(base_url: str, api_key: str | None) -> tuple[str, int]:
    with httpx.Client(base_url=base_url, timeout=30.0,
                      headers={"Authorization": f"Bearer {api_key}"} if api_key else {}) as c:
        card = c.get("/v1/models").raise_for_status().json()["data"][0]
    return card["id"], int(card.get("max_model_len") or 2048)


def bench_against(cfg: BenchConfig, against: str, concurrencies: list[int], against_model: str | None = None,
                  out: Path | None = None) -> dict[str, Any]:
    """The same streamed workload against `cfg.base_url` (lmforge) and `against`, at each concurrency
    in turn (max_concurrency = c, all requests queued at once); returns (and writes, with `out`)
    tok/s and TTFT per server and concurrency and the ratios lmforge / other."""
    ours, our_len = _first_model(cfg.base_url, cfg.api_key)
    theirs, their_len = _first_model(against, cfg.api_key)
    reqs = make_workload(cfg, min(our_len, their_len))  # one workload, clipped to fit both servers
    runs: dict[str, dict[str, Any]] = {"lmforge": {}, "against": {}}
    for c in concurrencies:
        for side, url, model in (("lmforge", cfg.base_url, cfg.model or ours), ("against", against,
                                                                                against_model or theirs)):
            run_cfg = dataclasses.replace(cfg, base_url=url, max_concurrency=c, request_rate=math.inf)
            load = os.getloadavg()[0]
            results, duration = asyncio.run(_run_requests(run_cfg, model, reqs))
            runs[side][str(c)] = {**summarize(run_cfg, results, duration), "load_avg_1m_before": load}
    ratios = {c: {"output_throughput": runs["lmforge"][c]["output_throughput"] /
                  max(runs["against"][c]["output_throughput"], 1e-9),
                  "ttft_p50_other_over_lmforge": runs["against"][c]["ttft_ms"]["p50"] /
                  max(runs["lmforge"][c]["ttft_ms"]["p50"], 1e-9)} for c in runs["lmforge"]}
    report = {"config": {**asdict(cfg), "against": against, "concurrencies": concurrencies,
                         "models": {"lmforge": cfg.model or ours, "against": against_model or theirs}},
              "runs": runs, "ratios": ratios,
              "provenance": {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "packages": package_versions(),
                             "hardware": hardware_info(), "cpu_model": _cpu_model(), "cpus": os.cpu_count()}}
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(out) / "against.json", report)
        atomic_write_text(Path(out) / "against.md", against_markdown(report))
    return report


def _cpu_model() -> str | None:
    try:
        return next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                     if ln.startswith("model name")), None)
    except OSError:
        return None


def against_markdown(report: dict[str, Any]) -> str:
    cfg, runs, p = report["config"], report["runs"], report["provenance"]
    lines = [f"# bench serve: lmforge ({cfg['base_url']}, {cfg['models']['lmforge']}) against {cfg['against']} "
             f"({cfg['models']['against']})", "",
             f"{cfg['num_prompts']} streamed requests per run, workload `{cfg['workload']}`, seed {cfg['seed']}, all "
             f"queued at once, at most c in flight; {p['date']}; {p['cpu_model'] or p['hardware']['machine']}, "
             f"{p['cpus']} CPUs. Load average (1 min) before each run is listed: above ~0.5 the machine was busy "
             "and the figures are not idle-machine figures.", "",
             "| c | lmforge tok/s | other tok/s | lmforge / other | TTFT p50 lmforge (ms) | TTFT p50 other (ms) "
             "| other / lmforge TTFT | load before (lmforge, other) | failed (lmforge, other) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for c, r in report["ratios"].items():
        a, b = runs["lmforge"][c], runs["against"][c]
        lines.append(f"| {c} | {a['output_throughput']:.1f} | {b['output_throughput']:.1f} | "
                     f"{r['output_throughput']:.2f}x | {a['ttft_ms']['p50']:.0f} | {b['ttft_ms']['p50']:.0f} | "
                     f"{r['ttft_p50_other_over_lmforge']:.2f}x | {a['load_avg_1m_before']:.2f}, "
                     f"{b['load_avg_1m_before']:.2f} | {a['failed']}, {b['failed']} |")
    return "\n".join(lines) + "\n"
