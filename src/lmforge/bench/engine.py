"""`lmforge bench engine`: the inference engine against the baselines it must beat, in one process,
on the same requests.

Systems (`--baselines`, comma-separated; all by default):
  hf-sequential  `transformers` `generate()`, one request at a time, on a fixed random subset of the
                 requests (`--hf-sequential-requests`; it is the slowest by far) — its tok/s is
                 that subset's, and its latencies are per request, from the request's own start;
  static         static batching: batches of `--static-batch-size`, the next batch admitted only when
                 the whole batch has finished, K/V preallocated contiguously for `max_model_len` per
                 request. It runs lmforge's own `Transformer` (so only the policy differs from the
                 engine): each prompt prefilled alone, then the whole batch decodes together until
                 its longest request ends (finished rows keep computing, as `generate()` does);
  hf-cb          `transformers` continuous batching (`init_continuous_batching`), where installed;
  lmforge        `LLM.generate` (paged KV, continuous batching, chunked prefill, prefix cache).
Every request asks for exactly its output length (EOS ignored), greedy. Batch systems get every
request at t = 0, so TTFT includes queueing. Reported: output tokens/s, requests/s, TTFT and TPOT
(= (last token - first token) / (tokens - 1)) mean/p50/p90/p99, and KV utilization = tokens held
in KV / token slots reserved, averaged over steps: contiguous (static) vs paged (lmforge).
`shared-prefix` also runs lmforge with the prefix cache off, for the mean-TTFT comparison.

Workloads (fixed seed): high-variance (prompt 16-512, output 8-512 tokens, log-uniform),
uniform (128 + 128), shared-prefix (a 1,024-token system prompt shared by all requests, then
16-128 own tokens, output 8-128, log-uniform). Without `--model`, a random ~30M-parameter Llama
(hidden 512, 8 layers, vocab 8192) is built once under `--out`.

On a shared CPU, intra-op threads under contention are catastrophically slow: `--threads`
(default 1) is applied with `torch.set_num_threads` and recorded. Compare systems by their ratios
within one run, never across runs.

    lmforge bench engine --num-requests 200 --out runs/bench-engine
    python -m lmforge.bench.engine --workload shared-prefix --baselines lmforge
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import torch
import torch.nn.functional as F
import typer

from lmforge.model.reference import save_hf_model
from lmforge.perf.estimate import decode_ceiling
from lmforge.quant import load_pretrained
from lmforge.track.io import atomic_write_json, atomic_write_text
from lmforge.track.short import short_mode, shrink

from .report import loadavg, provenance

WORKLOADS = ("high-variance", "shared-prefix", "uniform")
SYSTEMS = ("hf-sequential", "static", "hf-cb", "lmforge")
SHARED_PREFIX_LEN = 1024


@dataclass
class BenchEngineConfig:
    model: str | None = None  # None: a random ~30M Llama built under `out`
    workload: str = "high-variance"
    num_requests: int = 200
    dtype: str = "bfloat16"
    baselines: tuple[str, ...] = SYSTEMS
    hf_sequential_requests: int = 12  # the random subset hf-sequential runs
    static_batch_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    threads: int = 1
    seed: int = 0
    out: str = "runs/bench-engine"
    kv_cache_dtype: str = "auto"  # lmforge: auto | int8
    kv_cache_memory_bytes: int | None = None  # lmforge: a fixed KV budget (None: the engine's default)
    quant_activations: str = "none"  # lmforge on a w8/w4 model: none (exact A16) | int8 (A8 integer dots)

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"--workload {self.workload!r}: choose one of {', '.join(WORKLOADS)}")
        bad = set(self.baselines) - set(SYSTEMS)
        if bad:
            raise ValueError(f"--baselines: unknown {sorted(bad)}; choose from {', '.join(SYSTEMS)}")
        if min(self.num_requests, self.hf_sequential_requests, self.static_batch_size, self.threads) < 1:
            raise ValueError("--num-requests, --hf-sequential-requests, --static-batch-size, --threads must be >= 1")
        if self.quant_activations not in ("auto", "none", "int8"):
            raise ValueError(f"--quant-activations {self.quant_activations!r}: choose auto, none or int8")


@dataclass
class Request:
    prompt: list[int]
    output_len: int


def make_requests(workload: str, n: int, seed: int, vocab_size: int, max_len: int | None = None) -> list[Request]:
    """The workload's requests; with `max_len` (the model's context), each request's prompt and output
    lengths are cut so that prompt + output fits (prompt to at most half of it)."""
    reqs = _make_requests(workload, n, seed, vocab_size)
    if max_len is None:
        return reqs
    fitted = []
    for r in reqs:
        prompt = r.prompt if len(r.prompt) + r.output_len <= max_len else r.prompt[:max(1, max_len // 2)]
        fitted.append(Request(prompt, max(1, min(r.output_len, max_len - len(prompt)))))
    return fitted


def _make_requests(workload: str, n: int, seed: int, vocab_size: int) -> list[Request]:
    rng = random.Random(seed)

    def log_uniform(lo: int, hi: int) -> int:
        return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))

    def tokens(k: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(k)]  # ids 0-2: pad, bos, eos

    prefix = tokens(SHARED_PREFIX_LEN)
    if workload == "high-variance":
        return [Request(tokens(log_uniform(16, 512)), log_uniform(8, 512)) for _ in range(n)]
    if workload == "uniform":
        return [Request(tokens(128), 128) for _ in range(n)]
    return [Request(prefix + tokens(log_uniform(16, 128)), log_uniform(8, 128)) for _ in range(n)]


def random_model(out: Path) -> Path:
    """A random Llama, hidden 512, 8 layers, 8 heads, vocab 8192 (~29M parameters), built once; under
    LMFORGE_SHORT (CI) a ~0.3M one of the same shape family (hidden 64, 2 layers, vocab 512)."""
    if short_mode():
        path = out / "random-llama-short"
        if not (path / "config.json").exists():
            save_hf_model("llama", path, vocab_size=512, hidden_size=64, layers=2, num_attention_heads=4,
                          num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=False)
        return path
    path = out / "random-llama-30m"
    if not (path / "config.json").exists():
        save_hf_model("llama", path, vocab_size=8192, hidden_size=512, layers=8, num_attention_heads=8,
                      num_key_value_heads=8, max_position_embeddings=2048, tie_word_embeddings=False)
    return path


# ---- metrics -----------------------------------------------------------------------------------------


def _pcts(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """mean, p50, p90, p99 (linear interpolation), in ms by default."""
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    v = sorted(values)

    def pct(q: float) -> float:
        k = (len(v) - 1) * q
        lo, hi = math.floor(k), math.ceil(k)
        return v[lo] + (v[hi] - v[lo]) * (k - lo)

    return {"mean": scale * sum(v) / len(v), "p50": scale * pct(0.5), "p90": scale * pct(0.9), "p99": scale * pct(0.99)}


def summarize(name: str, duration: float, starts: list[float], token_times: list[list[float]],
              note: str = "", **extra: Any) -> dict[str, Any]:
    """token_times[i]: when request i's output tokens appeared; starts[i]: its arrival."""
    out_tokens = sum(len(t) for t in token_times)
    ttft = [t[0] - s for s, t in zip(starts, token_times) if t]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in token_times if len(t) > 1]
    return {"system": name, "requests": len(token_times), "output_tokens": out_tokens, "duration_s": duration,
            "output_tok_s": out_tokens / duration, "req_s": len(token_times) / duration,
            "ttft_ms": _pcts(ttft), "tpot_ms": _pcts(tpot), "note": note, **extra}


def _progress(total: int, desc: str):
    from tqdm.auto import tqdm  # deferred: only when the benchmark runs; `lmforge --help` imports this module

    return tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True, file=sys.stderr)


# ---- 1. transformers, one request at a time ----------------------------------------------------------


def run_hf_sequential(model_dir: Path, dtype, reqs: list[Request]) -> dict[str, Any]:
    import transformers  # deferred: transformers, only for the baselines that run it
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):  # generate() calls put() with the prompt, then once per new token
        def __init__(self):
            self.times: list[float] = []
            self.calls = 0

        def put(self, value):
            self.calls += 1
            if self.calls > 1:
                self.times.append(time.perf_counter())

        def end(self):
            pass

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()

    def one(r: Request, streamer=None):
        ids = torch.tensor([r.prompt])
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=r.output_len,
                       min_new_tokens=r.output_len, eos_token_id=None, pad_token_id=0, streamer=streamer)

    with torch.inference_mode():
        one(Request(reqs[0].prompt[:16], 4))  # warm-up
        starts, times, bar = [], [], _progress(len(reqs), "hf-sequential")
        t0 = time.perf_counter()
        for r in reqs:
            clock = Clock()
            starts.append(time.perf_counter())
            one(r, clock)
            times.append(clock.times)
            bar.update(1)
        duration = time.perf_counter() - t0
        bar.close()
    return summarize("hf-sequential", duration, starts, times,
                     note=f"a fixed random subset of {len(reqs)} requests; latencies from each request's own start")


# ---- 2. static batching, contiguous KV, lmforge's model ----------------------------------------------


class ContiguousKV:
    """Attention over a preallocated (S, K, L, H) cache per layer, L = max_model_len: either one row's
    prefill (`row` set, B = 1) or one decode token for every row (B = S) at positions `lens_S`."""

    def __init__(self, num_layers: int, S: int, L: int, K: int, H: int, dtype, device):
        self.k_SKLH = [torch_zeros((S, K, L, H), dtype, device) for _ in range(num_layers)]
        self.v_SKLH = [torch_zeros((S, K, L, H), dtype, device) for _ in range(num_layers)]
        self.row: int | None = None
        self.lens_S = None  # decode: tokens already cached per row
        self.mask_S11C = None

    def __call__(self, layer: int, q_BTNH, k_BTKH, v_BTKH):
        k_c, v_c = self.k_SKLH[layer], self.v_SKLH[layer]
        gqa = q_BTNH.shape[2] != k_BTKH.shape[2]
        if self.row is not None:
            T = q_BTNH.shape[1]
            k_c[self.row, :, :T] = k_BTKH[0].transpose(0, 1)
            v_c[self.row, :, :T] = v_BTKH[0].transpose(0, 1)
            out = F.scaled_dot_product_attention(q_BTNH.transpose(1, 2), k_BTKH.transpose(1, 2),
                                                 v_BTKH.transpose(1, 2), is_causal=True, enable_gqa=gqa)
            return out.transpose(1, 2)
        S = q_BTNH.shape[0]
        rows = self.rows_S
        k_c[rows, :, self.lens_S] = k_BTKH[:, 0]
        v_c[rows, :, self.lens_S] = v_BTKH[:, 0]
        C = self.mask_S11C.shape[-1]
        out = F.scaled_dot_product_attention(q_BTNH.transpose(1, 2), k_c[:S, :, :C], v_c[:S, :, :C],
                                             attn_mask=self.mask_S11C, enable_gqa=gqa)
        return out.transpose(1, 2)


def torch_zeros(shape, dtype, device):
    return torch.zeros(shape, dtype=dtype, device=device)


def run_static(model_dir: Path, dtype: str, reqs: list[Request], batch_size: int, max_model_len: int) -> dict[str, Any]:
    model = load_pretrained(model_dir, dtype=dtype, device="cpu").eval()
    c = model.config
    kv = ContiguousKV(c.num_hidden_layers, batch_size, max_model_len, c.num_key_value_heads, c.head_dim,
                      next(model.parameters()).dtype, "cpu")
    util_sum, steps = 0.0, 0

    def batch(rs: list[Request], times: list[list[float]]) -> None:
        nonlocal util_sum, steps
        S = len(rs)
        lens = [len(r.prompt) for r in rs]
        next_ids = []
        for i, r in enumerate(rs):  # prefill each prompt into its row
            kv.row = i
            h = model.hidden_states(torch.tensor([r.prompt]), attn=kv)
            next_ids.append(int(model.lm_head(h[0, -1]).argmax()))
            times[i].append(time.perf_counter())
        kv.row = None
        kv.rows_S = torch.arange(S)
        for _ in range(max(r.output_len for r in rs) - 1):
            lens_S = torch.tensor(lens)
            kv.lens_S = lens_S
            C = max(lens) + 1
            kv.mask_S11C = (torch.arange(C)[None, :] <= lens_S[:, None])[:, None, None, :]
            h = model.hidden_states(torch.tensor(next_ids)[:, None], lens_S[:, None], attn=kv)
            next_ids = model.lm_head(h[:, 0]).argmax(-1).tolist()
            now = time.perf_counter()
            for i, r in enumerate(rs):
                if len(times[i]) < r.output_len:
                    times[i].append(now)
            # a finished row keeps computing (as generate() does) but stops advancing: it never needs
            # a slot past its own prompt + output, so max_model_len per row always suffices
            lens = [min(n + 1, len(r.prompt) + r.output_len - 1) for n, r in zip(lens, rs)]
            util_sum += sum(lens) / (batch_size * max_model_len)  # every row holds its K/V until the batch ends
            steps += 1

    with torch.inference_mode():
        batch([Request(reqs[0].prompt[:16], 3)], [[]])  # warm-up
        util_sum, steps = 0.0, 0
        times: list[list[float]] = [[] for _ in reqs]
        bar = _progress(len(reqs), "static")
        t0 = time.perf_counter()
        for b in range(0, len(reqs), batch_size):
            batch(reqs[b:b + batch_size], times[b:b + batch_size])
            bar.update(len(reqs[b:b + batch_size]))
        duration = time.perf_counter() - t0
        bar.close()
    return summarize("static", duration, [t0] * len(reqs), times,
                     note=f"batches of {batch_size}, KV contiguous for max_model_len {max_model_len}",
                     kv_utilization=util_sum / max(steps, 1))


# ---- 3. transformers continuous batching -------------------------------------------------------------


def run_hf_cb(model_dir: Path, dtype, reqs: list[Request], max_num_seqs: int) -> dict[str, Any]:
    import transformers  # deferred: transformers, only for the baselines that run it

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype,
                                                              attn_implementation="sdpa").eval()
    if not hasattr(model, "init_continuous_batching"):
        return {"system": "hf-cb", "skipped": f"transformers {transformers.__version__} has no continuous batching"}
    gen = transformers.GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=512)
    # its cache is sized from free memory by default (22 s of zeroing on a 2-core box before the first token);
    # a short run (LMFORGE_SHORT, CI) gives it the pages this workload needs
    pages = {"num_blocks": sum(-(-(len(r.prompt) + r.output_len) // 256) for r in reqs) + 4} if short_mode() else {}
    cb = transformers.ContinuousBatchingConfig(max_requests_per_batch=max_num_seqs, auto_switch_to_flash=False,
                                               **pages)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    try:
        with torch.inference_mode():
            manager.add_request(reqs[0].prompt[:16], request_id="warmup", max_new_tokens=3, eos_token_id=[])
            manager.get_result(request_id="warmup", timeout=600)
            t0 = time.perf_counter()
            for i, r in enumerate(reqs):
                manager.add_request(r.prompt, request_id=str(i), max_new_tokens=r.output_len, eos_token_id=[],
                                    record_timestamps=True)
            got, bar = {}, _progress(len(reqs), "hf-cb")
            while len(got) < len(reqs):
                res = manager.get_result(timeout=600)
                if res is None:
                    raise RuntimeError("transformers continuous batching stalled for 600 s")
                if res.request_id in got or res.request_id == "warmup" or not res.is_finished():
                    continue
                got[res.request_id] = res
                bar.update(1)
            duration = time.perf_counter() - t0
            bar.close()
    finally:
        manager.stop(block=True)
    times = []
    for i in range(len(reqs)):
        res = got[str(i)]
        ts = list(res.timestamps or [])
        # transformers stamps tokens with time.perf_counter, our clock too
        times.append(ts if len(ts) == len(res.generated_tokens) else [t0 + duration] * len(res.generated_tokens))
    return summarize("hf-cb", duration, [t0] * len(reqs), times,
                     note=f"transformers {transformers.__version__} generate_batch manager, sdpa")


# ---- 4. lmforge --------------------------------------------------------------------------------------


def run_lmforge(model_dir: Path, dtype: str, reqs: list[Request], cfg: BenchEngineConfig, max_model_len: int,
                enable_prefix_caching: bool = True, name: str = "lmforge") -> dict[str, Any]:
    # deferred: only when the benchmark runs; `lmforge --help` imports this module
    from lmforge.engine import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype=dtype, device="cpu", max_num_seqs=cfg.max_num_seqs,
              max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=max_model_len,
              enable_prefix_caching=enable_prefix_caching, kv_cache_dtype=cfg.kv_cache_dtype,
              kv_cache_memory_bytes=cfg.kv_cache_memory_bytes, quant_activations=cfg.quant_activations)
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True, output_kind="final_only")
              for r in reqs]
    llm.generate([[5] * 16], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    before = llm.stats()
    t0_wall, t0 = time.time(), time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params, use_tqdm=True)
    duration = time.perf_counter() - t0
    s = llm.stats()
    times = [[t - t0_wall + t0 for t in o.outputs[0].token_times] for o in outs]
    steps = s["steps"] - before["steps"]
    return summarize(name, duration, [t0] * len(reqs), times,
                     note=f"max_num_seqs {cfg.max_num_seqs}, max_num_batched_tokens {cfg.max_num_batched_tokens}, "
                          f"prefix cache {'on' if enable_prefix_caching else 'off'}, "
                          f"attention {llm.llm_engine.model_runner.attention_backend}, "
                          f"{llm.llm_engine.model_runner.fused_modules} fused modules, "
                          f"KV {cfg.kv_cache_dtype} ({s['kv_pool_tokens']} tokens), linear {s['linear_backend']}",
                     kv_utilization=(s["kv_util_sum"] - before["kv_util_sum"]) / max(steps, 1), steps=steps,
                     preemptions=s["preemptions"] - before["preemptions"],
                     prefix_cache_hit_rate=((s["prefix_cache_hits"] - before["prefix_cache_hits"]) /
                                            max(s["prefix_cache_queries"] - before["prefix_cache_queries"], 1)),
                     step_profile=llm.llm_engine.step_profile())


# ---- the run -----------------------------------------------------------------------------------------


def bench_engine_run(cfg: BenchEngineConfig, command: str | None = None) -> dict[str, Any]:
    torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(cfg.model) if cfg.model else random_model(out)

    mc = json.loads((model_dir / "config.json").read_text())
    reqs = make_requests(cfg.workload, cfg.num_requests, cfg.seed, mc["vocab_size"], mc.get("max_position_embeddings"))
    block = 16
    max_model_len = -(-max(len(r.prompt) + r.output_len for r in reqs) // block) * block
    torch_dtype = getattr(torch, cfg.dtype)
    report: dict[str, Any] = {
        "config": asdict(cfg), "command": command or _command(), "model": str(model_dir),
        "max_model_len": max_model_len,
        "requests": {"count": len(reqs), "prompt_tokens": sum(len(r.prompt) for r in reqs),
                     "output_tokens": sum(r.output_len for r in reqs)},
        "provenance": provenance(cfg.dtype),
        "systems": [],
    }

    def save() -> None:
        atomic_write_json(out / "bench.json", report)
        atomic_write_text(out / "bench.md", to_markdown(report))

    for name in [s for s in SYSTEMS if s in cfg.baselines]:
        print(f"[bench engine] {name} ...", file=sys.stderr, flush=True)
        if name == "hf-sequential":
            subset = random.Random(cfg.seed + 1).sample(reqs, min(cfg.hf_sequential_requests, len(reqs)))
            r = run_hf_sequential(model_dir, torch_dtype, subset)
        elif name == "static":
            r = run_static(model_dir, cfg.dtype, reqs, cfg.static_batch_size, max_model_len)
        elif name == "hf-cb":
            r = run_hf_cb(model_dir, torch_dtype, reqs, cfg.max_num_seqs)
        else:
            r = run_lmforge(model_dir, cfg.dtype, reqs, cfg, max_model_len)
        report["systems"].append(r)
        save()
        if name == "lmforge" and cfg.workload == "shared-prefix":
            off = run_lmforge(model_dir, cfg.dtype, reqs, cfg, max_model_len, enable_prefix_caching=False,
                              name="lmforge (prefix cache off)")
            report["systems"].append(off)
            report["prefix_cache"] = {"mean_ttft_ms_on": r["ttft_ms"]["mean"], "mean_ttft_ms_off": off["ttft_ms"]["mean"],
                                      "ttft_reduction": 1 - r["ttft_ms"]["mean"] / off["ttft_ms"]["mean"]}
            save()
    report["provenance"]["load_average_end"] = loadavg()
    report["ratios"] = _ratios(report["systems"])
    report["bandwidth"] = _decode_vs_ceiling(model_dir, cfg.dtype, reqs, report["systems"])
    save()
    print(to_markdown(report))
    return report


def _command() -> str:
    prog = Path(sys.argv[0]).name
    prog = "python -m lmforge.bench.engine" if prog == "engine.py" else prog
    return " ".join([prog] + sys.argv[1:])


def _ratios(systems: list[dict]) -> dict[str, float]:
    by = {s["system"]: s for s in systems if "output_tok_s" in s}
    lm = by.get("lmforge")
    if lm is None:
        return {}
    return {f"lmforge_over_{k}": lm["output_tok_s"] / v["output_tok_s"] for k, v in by.items() if k != "lmforge"
            and k in SYSTEMS}


def _decode_vs_ceiling(model_dir: Path, dtype: str, reqs: list, systems: list[dict]) -> dict[str, Any] | None:
    """lmforge's output tok/s as a percentage of the decode ceiling (`perf.estimate.decode_ceiling`:
    measured memory bandwidth ÷ bytes read per step, at the run's mean batch and mean context). The
    run's time includes prefill, so this is a lower bound on decode's share of the ceiling."""
    lm = next((s for s in systems if s["system"] == "lmforge"), None)
    if lm is None or not lm.get("steps"):
        return None
    batch = max(1, round(sum(r.output_len for r in reqs) / lm["steps"]))
    context = round(sum(len(r.prompt) + r.output_len / 2 for r in reqs) / len(reqs))
    try:
        ceiling = decode_ceiling(model_dir, "cpu", batch, context, dtype)
    except Exception as e:  # no bandwidth in the hardware profile yet: say how to get one
        return {"error": f"{type(e).__name__}: {e} (run `lmforge doctor`)"}
    return {"mean_batch": batch, "mean_context": context, "ceiling_tok_s": ceiling,
            "percent_of_ceiling": 100 * lm["output_tok_s"] / ceiling}


def to_markdown(report: dict[str, Any]) -> str:
    cfg, p = report["config"], report["provenance"]
    lines = [f"# bench engine: workload `{cfg['workload']}`, {report['requests']['count']} requests",
             "", f"`{report['command']}`", "",
             f"{p['date']} on {p['machine']}, "
             f"torch {p['packages'].get('torch')}, transformers {p['packages'].get('transformers')}, "
             f"{cfg['dtype']}, {p['threads']} thread(s), load average at start {p['load_average']}"
             f"{', at end ' + str(p['load_average_end']) if 'load_average_end' in p else ''}; model `{report['model']}`, "
             f"max_model_len {report['max_model_len']}; {report['requests']['prompt_tokens']} prompt + "
             f"{report['requests']['output_tokens']} output tokens.", "",
             "| system | requests | output tok/s | req/s | TTFT mean / p50 / p90 / p99 (ms) | "
             "TPOT mean / p50 / p90 / p99 (ms) | KV utilization | notes |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in report["systems"]:
        if "skipped" in s:
            lines.append(f"| {s['system']} | | | | | | | skipped: {s['skipped']} |")
            continue
        t, tp = s["ttft_ms"], s["tpot_ms"]
        kv = f"{100 * s['kv_utilization']:.1f}%" if "kv_utilization" in s else "n/a"
        lines.append(f"| {s['system']} | {s['requests']} | {s['output_tok_s']:.1f} | {s['req_s']:.3f} | "
                     f"{t['mean']:.0f} / {t['p50']:.0f} / {t['p90']:.0f} / {t['p99']:.0f} | "
                     f"{tp['mean']:.1f} / {tp['p50']:.1f} / {tp['p90']:.1f} / {tp['p99']:.1f} | {kv} | {s['note']} |")
    if report.get("ratios"):
        lines += ["", "lmforge output tok/s over: " + ", ".join(f"{k.removeprefix('lmforge_over_')} "
                                                                 f"{v:.2f}x" for k, v in report["ratios"].items())]
    if "prefix_cache" in report:
        pc = report["prefix_cache"]
        lines += ["", f"Prefix cache: mean TTFT {pc['mean_ttft_ms_on']:.0f} ms on vs {pc['mean_ttft_ms_off']:.0f} ms "
                      f"off ({100 * pc['ttft_reduction']:.0f}% lower)."]
    bw = report.get("bandwidth")
    if bw and "percent_of_ceiling" in bw:
        lines += ["", f"Decode vs the bandwidth ceiling: lmforge {bw['percent_of_ceiling']:.0f}% of "
                      f"{bw['ceiling_tok_s']:.0f} tok/s (measured bandwidth ÷ bytes per step at mean batch "
                      f"{bw['mean_batch']}, context {bw['mean_context']}; prefill time included)."]
    elif bw:
        lines += ["", f"Decode vs the bandwidth ceiling: not computed ({bw['error']})."]
    prof = next((s.get("step_profile") for s in report["systems"] if s["system"] == "lmforge"), None)
    if prof:
        lines += ["", "lmforge step-time profile (share of engine step time):", "",
                  "| phase | seconds | share |", "| --- | --- | --- |"]
        total = sum(prof.values()) or 1.0
        lines += [f"| {k} | {v:.2f} | {100 * v / total:.1f}% |" for k, v in prof.items()]
    return "\n".join(lines) + "\n"


def bench_engine(
    model: Annotated[Optional[Path], typer.Option(help="A Hugging Face layout model directory (default: a "
                                                      "random ~30M Llama, built under --out).")] = None,
    workload: Annotated[str, typer.Option(help="high-variance | shared-prefix | uniform.")] = "high-variance",
    num_requests: Annotated[int, typer.Option(help="Requests in the workload.")] = 200,
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16 | float16.")] = "bfloat16",
    baselines: Annotated[str, typer.Option(help="Comma-separated systems to run: " + ",".join(SYSTEMS))]
    = ",".join(SYSTEMS),
    hf_sequential_requests: Annotated[int, typer.Option(help="Size of the random subset hf-sequential runs.")] = 12,
    static_batch_size: Annotated[int, typer.Option(help="Static batching's batch size.")] = 16,
    max_num_seqs: Annotated[int, typer.Option(help="lmforge / hf-cb: most sequences per step.")] = 256,
    max_num_batched_tokens: Annotated[int, typer.Option(help="lmforge: per-step token budget.")] = 2048,
    threads: Annotated[int, typer.Option(help="torch.set_num_threads (1 is fastest on a shared CPU).")] = 1,
    seed: Annotated[int, typer.Option(help="Workload seed.")] = 0,
    out: Annotated[Path, typer.Option(help="Where bench.json and bench.md go.")] = Path("runs/bench-engine"),
    kv_cache_dtype: Annotated[str, typer.Option(help="lmforge: auto (the model's dtype) | int8.")] = "auto",
    kv_cache_memory_bytes: Annotated[Optional[int], typer.Option(help="lmforge: KV pool budget in bytes.")] = None,
    quant_activations: Annotated[str, typer.Option(help="lmforge on a w8/w4 model: none (exact) | int8.")] = "none",
) -> None:
    """Engine throughput and latency against transformers (one at a time, continuous batching) and
    static batching, on the same requests; KV utilization; prefix-cache TTFT. Writes bench.json, bench.md."""
    try:  # LMFORGE_SHORT (CI): 8 requests on the short random model, 2 of them through transformers
        cfg = BenchEngineConfig(model=str(model) if model else None, workload=workload,
                                num_requests=shrink(num_requests, 8), dtype=dtype,
                                baselines=tuple(b.strip() for b in baselines.split(",") if b.strip()),
                                hf_sequential_requests=shrink(hf_sequential_requests, 2),
                                static_batch_size=static_batch_size,
                                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                threads=threads, seed=seed, out=str(out), kv_cache_dtype=kv_cache_dtype,
                                kv_cache_memory_bytes=kv_cache_memory_bytes, quant_activations=quant_activations)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    bench_engine_run(cfg)


if __name__ == "__main__":
    typer.run(bench_engine)
