"""lmforge beside OpenVINO GenAI and llama.cpp on one CPU, the engines alone (issue 44).

One Hugging Face folder (default: the issue's random 300M Llama, `scripts/vs_llamacpp.py`'s SHAPE;
`--model DIR` for another) at three precisions, each engine at its own defaults and the same thread count:

| precision | OpenVINO GenAI (optimum-intel export of the folder) | lmforge | llama.cpp |
| --- | --- | --- | --- |
| 16-bit | `--weight-format fp16` | the bf16 folder, `--dtype auto` | bf16 GGUF |
| 8-bit | `--weight-format int8` (per-channel) | Q8_0 GGUF | Q8_0 GGUF |
| 4-bit | `--weight-format int4 --sym --group-size 128 --ratio 1.0` | Q4_0 GGUF | Q4_0 GGUF |

(the GGUF files: `lmforge export --format gguf`'s writer, `lmforge.quant.gguf_export.export_gguf`, from
the same folder). Cells, on token-id prompts written once to prompts.json and given to every engine
(tokenizers play no part; each repeat its own prompt, so no prefix cache helps):

* prefill: one 512-token prompt, one output token: tok/s = 512 / wall time;
* decode at depth 128 and at depth 1,024: one sequence, a 128- or 1,024-token prompt, 128 tokens
  after the first (greedy, `ignore_eos`): tok/s over those 128;
* batch: 32 requests of 128 prompt and 128 output tokens, 16 in flight: output tok/s = 32 x 128 / wall.

Best of `--repeats` each; with `--rounds N` the engines take N turns at each precision (every other round in
reverse order) and each cell is the best of every round, each round's figures kept in the report: on this
shared VM a compute-bound cell moved ~15% between minutes-long phases, and a single run let such a phase
fall on one engine. How each engine runs them:

* OpenVINO GenAI: `scripts/openvino_bench.py` in its own environment (`--openvino-python`, default
  .venv-openvino/bin/python: `make openvino-env`), `LLMPipeline` for prefill and decode,
  `ContinuousBatchingPipeline` (`max_num_seqs` 16) for the batch; its defaults otherwise (bf16 compute
  where the CPU has it, u8 KV cache, dynamic int8 activations) and `INFERENCE_NUM_THREADS`;
* lmforge: `LLM(model, max_num_seqs=16)`, every other option its default (`--quant-activations` to
  override), in this process;
* llama.cpp (optional, `--llama-bench PATH`): `llama-bench -p 512 -n 0` and `-p 0 -n 128 -d 128,1024`;
  the batch cell with `--llama-batched-bench PATH` (`llama-batched-bench -npp 128 -ntg 128 -npl 16`:
  16 sequences at once, output tok/s = 16 x 128 / its total time, the rate of each of the batch's two
  waves of 16), else left empty.

Writes vs_openvino.json and vs_openvino.md to `--out`: every engine's figures, lmforge ÷ the best of the
others per cell, the machine, the CPU's flags, lmforge's kernels, OpenVINO's version and CPU plugin
settings, llama.cpp's build. A benchmark-only script: OpenVINO and llama.cpp are never test or lock
dependencies (docs/engine.md, "Against OpenVINO GenAI").

    make openvino-env
    python scripts/vs_openvino.py --out runs/vs-openvino --threads 2 \\
        --llama-bench /opt/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-bench \\
        --llama-batched-bench /opt/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-batched-bench \\
        --rounds 2

`LMFORGE_SHORT=1` (or `--short`): a 2-layer 128-wide model, prefill 64, depths 16 and 64, 16 decode
tokens, 8 requests of 16 + 16 tokens, 4 in flight, one repeat: the same code end to end, not figures to quote.
"""

from __future__ import annotations

import gc
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import torch
import typer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_llamacpp import SHAPE  # noqa: E402  the issue's random 300M Llama, the same folder as vs_llamacpp's

from lmforge.bench.report import emit, loadavg, provenance  # noqa: E402
from lmforge.track.short import short_mode  # noqa: E402

PRECISIONS = {  # name: (optimum-cli weight flags, lmforge's file, llama.cpp's file)
    "16-bit": (["--weight-format", "fp16"], "folder", "bf16"),
    "8-bit": (["--weight-format", "int8"], "q8_0", "q8_0"),
    "4-bit": (["--weight-format", "int4", "--sym", "--group-size", "128", "--ratio", "1.0"], "q4_0", "q4_0"),
}
OV_PYTHON = Path(".venv-openvino/bin/python")
OV_NAMES = {"16-bit": "fp16", "8-bit": "int8", "4-bit": "int4-sym-g128"}
TINY = dict(SHAPE, hidden_size=128, layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
            max_position_embeddings=2048)
FULL_SIZES = dict(prefill=512, depths=(128, 1024), decode=128, requests=32, concurrency=16, batch_prompt=128,
                  batch_output=128)
SHORT_SIZES = dict(prefill=64, depths=(16, 64), decode=16, requests=8, concurrency=4, batch_prompt=16,
                   batch_output=16)
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni",
             "avx_vnni_int8", "amx_tile", "amx_bf16", "amx_int8", "f16c", "avx512_fp16")


# ---- the model, its files and the prompts -------------------------------------------------------------

def make_tokenizer(out: Path) -> Path:
    """A byte-level BPE of 8,192 ids (lmforge's trainer on a few thousand generated words; its specials
    at 0..4 as the random 300M's bos/eos/pad expect). Only its files matter: every prompt is token ids."""
    from lmforge.tokenizer.train import train_tokenizer

    path = out / "tokenizer"
    if (path / "tokenizer.json").is_file():
        return path
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(4000)]
    corpus = out / "tokenizer-corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(words) for _ in range(20)) for _ in range(3000)))
    train_tokenizer([str(corpus)], path, vocab_size=8192, show_progress=False, overwrite=True)
    return path


def build_model(out: Path, tokenizer: Path | None, tiny: bool) -> Path:
    """The random 300M Llama (tiny: 2 layers of 128) as an HF folder in bf16 with a tokenizer."""
    from lmforge.model.reference import save_hf_model

    path = out / ("random-llama-tiny" if tiny else "random-llama-300m")
    if not (path / "config.json").is_file():
        tok = tokenizer if tokenizer is not None and (tokenizer / "tokenizer.json").is_file() else make_tokenizer(out)
        save_hf_model("llama", path, dtype=torch.bfloat16, **(TINY if tiny else SHAPE))
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tok / f).is_file():
                shutil.copy(tok / f, path / f)
    return path


def gguf_file(model: Path, out: Path, gguf_type: str) -> Path:
    from lmforge.quant.gguf_export import export_gguf

    f = out / "gguf" / f"{model.name}-{gguf_type}.gguf"
    if not f.is_file():
        f.parent.mkdir(parents=True, exist_ok=True)
        export_gguf(model, f, gguf_type)
    return f


def ov_export(ov_python: Path, model: Path, out: Path, precision: str) -> tuple[Path, dict]:
    """optimum-intel's export of `model` at `precision` (skipped when already there): its folder, and its
    command and NNCF's table of the bit widths it gave the weights (from export.log, kept beside it)."""
    dest = out / "openvino" / f"{model.name}-{OV_NAMES[precision]}"
    cli = ov_python.parent / "optimum-cli"
    cmd = [str(cli), "export", "openvino", "--model", str(model), "--task", "text-generation-with-past",
           *PRECISIONS[precision][0], str(dest)]
    log = dest / "export.log"
    if not (dest / "openvino_model.xml").is_file():
        print(f"vs_openvino: {' '.join(cmd)}", file=sys.stderr, flush=True)
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"optimum-cli export failed ({r.returncode}):\n{r.stderr[-3000:]}")
        log.write_text(r.stdout + r.stderr)
    text = log.read_text() if log.is_file() else ""
    bits = [x.strip() for x in text.splitlines() if x.startswith("│") and "%" in x]
    return dest, {"export_command": " ".join(cmd), "weight_bits": bits}


def write_prompts(out: Path, vocab: int, sizes: dict, repeats: int) -> tuple[Path, dict]:
    """Token ids every engine gets: ids 5.. (past the specials), a different prompt for each repeat."""
    rng = random.Random(1234)

    def ids(n: int) -> list[int]:
        return [rng.randrange(5, vocab) for _ in range(n)]

    p = {"prefill": [ids(sizes["prefill"]) for _ in range(repeats)],
         "depth": {str(d): [ids(d) for _ in range(repeats)] for d in sizes["depths"]},
         "decode_tokens": sizes["decode"],
         "batch": [[ids(sizes["batch_prompt"]) for _ in range(sizes["requests"])] for _ in range(repeats)],
         "batch_output": sizes["batch_output"], "concurrency": sizes["concurrency"]}
    # warm-ups on prompts of their own: a warm-up on a timed prompt leaves it in a prefix cache, and that repeat's
    # "prefill" then reads the cache (lmforge 4,082 and OpenVINO 15,876 tok/s in a run of 2026-12-06, dropped)
    p["warmup"] = {"prefill": ids(sizes["prefill"]),
                   "batch": [ids(sizes["batch_prompt"]) for _ in range(sizes["concurrency"])]}
    path = out / "prompts.json"
    path.write_text(json.dumps(p))
    return path, p


# ---- the engines --------------------------------------------------------------------------------------

def openvino_run(ov_python: Path, model: Path, prompts: Path, threads: int) -> dict:
    worker = Path(__file__).resolve().parent / "openvino_bench.py"
    cmd = [str(ov_python), str(worker), str(model), str(prompts), "--threads", str(threads)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    line = next((x for x in reversed(r.stdout.splitlines()) if x.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        sys.exit(f"openvino_bench.py failed ({r.returncode}):\n{r.stderr[-3000:]}")
    res = json.loads(line[len("RESULT "):])
    res["command"] = " ".join(cmd)
    return res


def lmforge_run(path: Path, prompts: dict, threads: int, quant_activations: str | None) -> dict:
    from lmforge.engine import LLM, SamplingParams

    torch.set_num_threads(threads)
    opts = {"max_num_seqs": int(prompts["concurrency"])}
    if quant_activations:
        opts["quant_activations"] = quant_activations
    llm = LLM(str(path), **opts)
    n_dec, n_out = int(prompts["decode_tokens"]), int(prompts["batch_output"])

    def params(n: int):
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    warm = prompts["warmup"]
    llm.generate([warm["prefill"]], params(1), use_tqdm=False)  # warm-up: kernels packed, allocator settled
    llm.generate([warm["prefill"][:16]], params(8), use_tqdm=False)
    prefill = []
    for ids in prompts["prefill"]:
        t0 = time.perf_counter()
        llm.generate([ids], params(1), use_tqdm=False)
        prefill.append(len(ids) / (time.perf_counter() - t0))
    res = {"prefill_tok_s": max(prefill), "prefill_all": prefill}
    for depth, runs in prompts["depth"].items():
        rates = []
        for ids in runs:
            tt = llm.generate([ids], params(n_dec + 1), use_tqdm=False)[0].outputs[0].token_times
            rates.append(n_dec / (tt[-1] - tt[0]))  # the tokens after the first
        res[f"decode_d{depth}_tok_s"], res[f"decode_d{depth}_all"] = max(rates), rates
    llm.generate([ids[:16] for ids in warm["batch"]], params(4), use_tqdm=False)
    rates = []
    for reqs in prompts["batch"]:
        t0 = time.perf_counter()
        outs = llm.generate(reqs, params(n_out), use_tqdm=False)
        dt = time.perf_counter() - t0
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
    res["batch_tok_s"], res["batch_all"] = max(rates), rates
    stats = llm.stats()
    res.update({k: stats.get(k) for k in ("dtype", "linear_backend", "attention_backend", "kv_cache_dtype",
                                          "quant_activations") if k in stats})
    res["options"] = {**opts, "model": str(path)}
    del llm
    gc.collect()
    return res


def llama_cpp_run(exe: Path, batched: Path | None, f: Path, threads: int, repeats: int, sizes: dict) -> dict:
    depths = ",".join(str(d) for d in sizes["depths"])
    cmds = [[str(exe), "-m", str(f), "-t", str(threads), "-p", str(sizes["prefill"]), "-n", "0", "-r", str(repeats),
             "-o", "json"],
            [str(exe), "-m", str(f), "-t", str(threads), "-p", "0", "-n", str(sizes["decode"]), "-d", depths,
             "-r", str(repeats), "-o", "json"]]
    res: dict = {"commands": [" ".join(c) for c in cmds]}
    for cmd in cmds:
        for r in json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout):
            key = "prefill" if r.get("n_prompt") else f"decode_d{r.get('n_depth', 0)}"
            res[f"{key}_tok_s"], res[f"{key}_stdev"] = r["avg_ts"], r.get("stddev_ts")
            res.update(build=f"{r.get('build_number')} ({r.get('build_commit')})", cpu_info=r.get("cpu_info"),
                       backends=r.get("backends"), type_k=r.get("type_k"), flash_attn=r.get("flash_attn"))
    if batched is not None:
        n, pp, tg = sizes["concurrency"], sizes["batch_prompt"], sizes["batch_output"]
        cmd = [str(batched), "-m", str(f), "-t", str(threads), "-c", str(n * (pp + tg)), "-npp", str(pp),
               "-ntg", str(tg), "-npl", str(n), "--output-format", "jsonl"]
        rates = []
        for _ in range(repeats):
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            row = next(json.loads(x) for x in out.splitlines() if x.startswith("{") and '"pl"' in x)
            rates.append(row["pl"] * row["tg"] / row["t"])
        res.update(batch_tok_s=max(rates), batch_all=rates, batch_command=" ".join(cmd))
    return res


# ---- the report ---------------------------------------------------------------------------------------

def cpu_flags() -> dict:
    try:
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags"))
    except (OSError, StopIteration):
        return {}
    have = set(line.split(":", 1)[1].split())
    return {f: f in have for f in CPU_FLAGS}


def lmforge_kernels() -> dict:
    from lmforge.engine import kernels

    info: dict = {"status": kernels.status()}
    try:
        lib = kernels.load()
        if lib is not None and hasattr(kernels, "a8_isa"):
            info["a8_isa"] = kernels.a8_isa(lib)
        if hasattr(kernels, "cpu_has_bf16"):
            info["cpu_bf16"] = kernels.cpu_has_bf16()
    except Exception as e:  # the kernels' API moves; the report must not fail on it
        info["error"] = str(e)[:200]
    return info


def cells(sizes: dict) -> list[tuple[str, str]]:
    return ([("prefill_tok_s", f"prefill {sizes['prefill']}")]
            + [(f"decode_d{d}_tok_s", f"decode @ depth {d}") for d in sizes["depths"]]
            + [("batch_tok_s", f"{sizes['requests']} req, {sizes['concurrency']} in flight (output)")])


def _engine_run(engine: str, prec: str, out: Path, model: Path, prompts_path: Path, prompts: dict, threads: int,
                repeats: int, ov_python: Path, llama_bench: Path | None, llama_batched: Path | None,
                quant_activations: str | None, sizes: dict) -> dict:
    """One engine's cells at one precision (its files made first when missing)."""
    _, lm_file, cpp_type = PRECISIONS[prec]
    if engine == "openvino":
        ov_dir, export = ov_export(ov_python, model, out, prec)
        return openvino_run(ov_python, ov_dir, prompts_path, threads) | export | {"format": OV_NAMES[prec]}
    if engine == "llama_cpp":
        f = gguf_file(model, out, cpp_type)
        return llama_cpp_run(llama_bench, llama_batched, f, threads, repeats, sizes) | {"format": cpp_type.upper()}
    path = model if lm_file == "folder" else gguf_file(model, out, lm_file)
    res = lmforge_run(path, prompts, threads, quant_activations)
    return res | {"format": "bf16 folder" if lm_file == "folder" else lm_file.upper()}


def merge_rounds(results: list[dict]) -> dict:
    """An engine's rounds as one result: each cell the best of every round (as the repeats within one), the
    first round's other fields, and each round's cells under `rounds`."""
    merged = dict(results[0])
    keys = sorted({k for r in results for k in r if k.endswith("_tok_s")})
    for k in keys:
        merged[k] = max(r[k] for r in results if r.get(k) is not None)
    merged["rounds"] = [{k: r.get(k) for k in keys} for r in results]
    return merged


def run(out: Path, model: Path, precisions: list[str], engines: list[str], threads: int, repeats: int,
        ov_python: Path, llama_bench: Path | None, llama_batched: Path | None, quant_activations: str | None,
        sizes: dict, rounds: int = 1) -> dict:
    """Every precision in turn; within one, `rounds` rounds of the engines, every other round in reverse order
    (lmforge first, then last), so that a slow phase of a shared VM (minutes long, ~15% on compute-bound cells)
    falls on all of them alike rather than on one."""
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts_path, prompts = write_prompts(out, vocab, sizes, repeats)
    order = [e for e in ("openvino", "llama_cpp", "lmforge")
             if e.replace("_", "") in engines and (e != "llama_cpp" or llama_bench is not None)]
    rows = []
    for prec in precisions:
        row: dict = {"precision": prec, "load_before": loadavg()}
        results: dict = {e: [] for e in order}
        for i in range(rounds):
            for e in (order if i % 2 == 0 else order[::-1]):
                results[e].append(_engine_run(e, prec, out, model, prompts_path, prompts, threads, repeats, ov_python,
                                              llama_bench, llama_batched, quant_activations, sizes))
        row.update({e: merge_rounds(rs) for e, rs in results.items()})
        if "lmforge" in row:
            for key, _ in cells(sizes):
                others = [row[e][key] for e in ("openvino", "llama_cpp") if e in row and row[e].get(key)]
                if others:
                    row.setdefault("ratio_vs_best", {})[key] = row["lmforge"][key] / max(others)
        rows.append(row)
        print(json.dumps({e: {k: round(v, 1) for k, v in row[e].items() if k.endswith("_tok_s")}
                          for e in ("openvino", "llama_cpp", "lmforge") if e in row} | {"precision": prec}),
              file=sys.stderr, flush=True)
    prov = provenance("auto")
    prov["threads"] = threads
    prov["cpu_flags"] = cpu_flags()
    return {"rows": rows, "sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in sizes.items()},
            "repeats": repeats, "rounds": rounds, "model": str(model), "short": short_mode(), "provenance": prov,
            "lmforge_kernels": lmforge_kernels()}


def _fmt(v) -> str:
    return f"{v:.1f}" if isinstance(v, (int, float)) else "—"


def to_markdown(rep: dict) -> str:
    p, sizes = rep["provenance"], rep["sizes"]
    cs = cells(sizes)
    flags = ", ".join(f for f, on in p.get("cpu_flags", {}).items() if on) or "?"
    lines = ["# lmforge beside OpenVINO GenAI and llama.cpp, engines alone" + (" (SHORT: not figures to quote)"
                                                                              if rep["short"] else ""), "",
             f"{p['machine']}; {p['threads']} threads; CPU flags: {flags}; {p['date']}; model `{rep['model']}`; "
             f"best of {rep['repeats']} x {rep.get('rounds', 1)} rounds (engines in turns); token-id prompts; "
             "load before each precision: "
             + ", ".join(str(r["load_before"]) for r in rep["rows"]), ""]
    ov = next((r["openvino"]["plugin"] for r in rep["rows"] if "openvino" in r), None)
    if ov:
        lines += [f"OpenVINO {ov['openvino']}, GenAI {ov['openvino_genai']}; CPU plugin: inference precision "
                  f"{ov.get('inference_precision_hint')}, KV cache {ov.get('kv_cache_precision')}, dynamic "
                  f"quantization group {ov.get('dynamic_quantization_group_size')}, capabilities "
                  f"{ov.get('optimization_capabilities')}", ""]
    for r in rep["rows"]:
        bits = r.get("openvino", {}).get("weight_bits")
        if bits:
            cells_ = [[c.strip() for c in b.strip("│").split("│")][:2] for b in bits]
            kept = [f"{c[0]} {c[1]}" for c in cells_ if len(c) == 2 and not c[0].startswith("Weight")]
            lines.append(f"OpenVINO {r['openvino']['format']} weights (NNCF): " + "; ".join(kept) + "  ")
    cpp = next((r["llama_cpp"] for r in rep["rows"] if "llama_cpp" in r), None)
    if cpp:
        lines += [f"llama.cpp build {cpp.get('build')}, backends {cpp.get('backends')}, `{cpp.get('cpu_info')}`", ""]
    k = rep.get("lmforge_kernels", {})
    lines += [f"lmforge kernels: {k.get('status')}; A8 body {k.get('a8_isa')}; CPU bf16 {k.get('cpu_bf16')}", ""]
    lines += ["| tok/s | engine, weights | " + " | ".join(c[1] for c in cs) + " |",
              "|---|---|" + "---:|" * len(cs)]
    for r in rep["rows"]:
        for e, name in (("openvino", "OpenVINO GenAI"), ("llama_cpp", "llama.cpp"), ("lmforge", "lmforge")):
            if e in r:
                lines.append(f"| {r['precision']} | {name} {r[e]['format']} | "
                             + " | ".join(_fmt(r[e].get(key)) for key, _ in cs) + " |")
        if "ratio_vs_best" in r:
            lines.append(f"| {r['precision']} | **lmforge ÷ best other** | "
                         + " | ".join(f"{r['ratio_vs_best'][key]:.2f}x" if key in r["ratio_vs_best"] else "—"
                                      for key, _ in cs) + " |")
    if rep.get("rounds", 1) > 1:  # each round's cells, to show how far a cell moved between rounds
        lines += ["", "Each round (in the order run; the table gives the best):"]
        for r in rep["rows"]:
            for e in ("openvino", "llama_cpp", "lmforge"):
                if e in r:
                    per = " | ".join(" / ".join(_fmt(x.get(key)) for x in r[e]["rounds"]) for key, _ in cs)
                    lines.append(f"- {r['precision']} {r[e]['format']}: {per}")
    lm = [r["lmforge"] for r in rep["rows"] if "lmforge" in r]
    if lm:
        lines += ["", "lmforge paths: " + "; ".join(f"{x['format']}: {x.get('dtype')}, {x.get('linear_backend')}, "
                                                     f"attention {x.get('attention_backend')}" for x in lm)]
    return "\n".join(lines) + "\n"


def main(out: Annotated[Path, typer.Option(help="Folder for the model, its exports and the report.")],
         model: Annotated[Optional[Path], typer.Option(help="A Hugging Face folder (default: the random 300M "
                                                            "Llama, built under --out).")] = None,
         threads: int = 2, repeats: int = 3,
         precision: Annotated[Optional[list[str]], typer.Option(help="16-bit, 8-bit, 4-bit (default: all).")] = None,
         engine: Annotated[Optional[list[str]], typer.Option(help="openvino, llamacpp, lmforge (default: all; "
                                                                  "llamacpp needs --llama-bench).")] = None,
         openvino_python: Annotated[Path, typer.Option(help="The benchmark-only environment's python "
                                                            "(`make openvino-env`).")] = OV_PYTHON,
         llama_bench: Annotated[Optional[Path], typer.Option(help="llama-bench binary.")] = None,
         llama_batched_bench: Annotated[Optional[Path], typer.Option(help="llama-batched-bench binary (the batch "
                                                                          "cell for llama.cpp).")] = None,
         quant_activations: Annotated[Optional[str], typer.Option(help="lmforge's quant_activations (default: the "
                                                                       "engine's own).")] = None,
         tokenizer: Annotated[Optional[Path], typer.Option(help="A tokenizer folder for the random model (default: "
                                                                "runs/quickstart/tokenizer if there, else one trained "
                                                                "here on generated words).")] = None,
         rounds: Annotated[int, typer.Option(help="Rounds of the engines at each precision, in turns (every other "
                                                  "round reversed); each cell the best of all.")] = 1,
         short: bool = typer.Option(False, "--short", help="As LMFORGE_SHORT=1.")) -> None:
    if short:
        os.environ["LMFORGE_SHORT"] = "1"
    is_short = short_mode()
    precisions = precision or list(PRECISIONS)
    engines = engine or ["openvino", "llamacpp", "lmforge"]
    bad = [x for x in precisions if x not in PRECISIONS] + [x for x in engines if x not in
                                                            ("openvino", "llamacpp", "lmforge")]
    if bad:
        raise typer.BadParameter(f"unknown {bad}: precisions {list(PRECISIONS)}, engines openvino/llamacpp/lmforge")
    if "openvino" in engines and not openvino_python.is_file():
        raise typer.BadParameter(f"{openvino_python} missing: `make openvino-env` creates the benchmark-only "
                                 "environment", param_hint="--openvino-python")
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    tok = tokenizer or Path("runs/quickstart/tokenizer")
    folder = model or build_model(out, tok, is_short)
    rep = run(out, folder, precisions, engines, threads, 1 if is_short else repeats, openvino_python,
              llama_bench, llama_batched_bench, quant_activations, SHORT_SIZES if is_short else FULL_SIZES,
              max(1, rounds))
    emit(rep, to_markdown, out, "vs_openvino")


if __name__ == "__main__":
    typer.run(main)
