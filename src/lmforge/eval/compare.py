"""Compare two eval runs task by task; refuse when a suite's bytes differ between them.

A difference in score means something only when both runs scored the same items, so a task
whose suite sha256 differs stops the comparison (`SuiteChangedError`) unless the caller
allows it, and then every such row is marked. Tasks present in one run only are listed with
the other side empty. This module knows nothing about models.

    rows, changed = compare_runs("runs/eval-a", "runs/eval-b")
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.eval.evaluate import RESULTS
from lmforge.track.io import atomic_write_json, atomic_write_text
from lmforge.track.run import RunDir


class SuiteChangedError(ValueError):
    """The two runs scored different versions of a suite; the message names the tasks and the override."""


@dataclass
class Row:
    task: str
    metric: str
    a: dict[str, Any] | None  # {"value", "stderr", "n"}
    b: dict[str, Any] | None
    suite_changed: bool

    @property
    def delta(self) -> float | None:
        if self.a is None or self.b is None:
            return None
        return self.b["value"] - self.a["value"]

    @property
    def z(self) -> float | None:
        """delta over its standard error, sqrt(se_a^2 + se_b^2) (independent runs)."""
        d = self.delta
        if d is None or self.a["stderr"] is None or self.b["stderr"] is None:
            return None
        se = math.sqrt(self.a["stderr"] ** 2 + self.b["stderr"] ** 2)
        return d / se if se > 0 else None


def load_results(run: str | os.PathLike) -> dict[str, Any]:
    path = Path(run) / RESULTS if Path(run).is_dir() else Path(run)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: not found; pass an eval run folder (the --out of `lmforge eval`) "
                                f"or its results.json") from None


def compare_runs(a: str | os.PathLike, b: str | os.PathLike,
                 allow_changed_suite: bool = False) -> tuple[list[Row], list[str]]:
    """(one row per task and metric, names of tasks whose suite changed)."""
    ra, rb = load_results(a)["tasks"], load_results(b)["tasks"]
    changed = sorted(t for t in ra.keys() & rb.keys() if ra[t]["suite_sha256"] != rb[t]["suite_sha256"])
    if changed and not allow_changed_suite:
        details = "; ".join(f"{t}: v{ra[t]['version']} {ra[t]['suite_sha256'][:12]} vs "
                            f"v{rb[t]['version']} {rb[t]['suite_sha256'][:12]}" for t in changed)
        raise SuiteChangedError(f"the runs scored different suite files ({details}); their scores are not "
                                f"comparable. Rerun both on the same suite, or pass --allow-changed-suite "
                                f"to compare anyway (the table marks those rows)")
    rows = []
    for task in sorted(ra.keys() | rb.keys()):
        ta, tb = ra.get(task), rb.get(task)
        names = list(dict.fromkeys([*(ta or {}).get("metrics", {}), *(tb or {}).get("metrics", {})]))
        for metric in names:
            rows.append(Row(task, metric, _cell(ta, metric), _cell(tb, metric), task in changed))
    return rows, changed


def _cell(task: dict[str, Any] | None, metric: str) -> dict[str, Any] | None:
    if task is None or metric not in task["metrics"]:
        return None
    return {**task["metrics"][metric], "n": task["n"]}


# ---- two models on the same items, per sample (`lmforge eval diff`) ----------------------------------

GREEDY_TOKENS = 32


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _nll(model, ids: list[int]) -> float:
    """Summed next-token negative log-likelihood of ids[1:] given the prefix (float32 math)."""
    import torch  # deferred: importing lmforge.eval stays cheap (torch loads when a model runs)

    with torch.no_grad():
        x = torch.tensor([ids])
        logp = model(x)[0, :-1].float().log_softmax(-1)
        return float(-logp.gather(1, x[0, 1:, None]).sum())


def _prefix(item: dict[str, Any], ids: list[int], tok) -> list[int]:
    """Where greedy continuation starts: a math item's prompt (up to 'Answer:'), else the first half (<= 64)."""
    if "prompt" in item:
        return tok.encode(item["prompt"])
    return ids[:max(1, min(64, len(ids) // 2))]


def diff_models(model_a: str | os.PathLike, model_b: str | os.PathLike, suite, out: str | os.PathLike,
                dtype: str = "float32", limit: int | None = None, overwrite: bool = False,
                quant_activations: tuple[str, str] = ("none", "none"),
                kv_cache_dtype: tuple[str, str] = ("auto", "auto")) -> dict[str, Any]:
    """Both models on every item of a perplexity suite: per item the summed NLL under each, the greedy
    continuation of each for GREEDY_TOKENS tokens from the item's prefix (same / changed, agreement =
    common-prefix length / GREEDY_TOKENS), and for items with an `answer`, whether each continuation
    starts with it (newly wrong / newly right); per category: perplexity of each and its change,
    mean agreement, counts. Writes per_sample.jsonl, diff.json, diff.md and a record into `out`.
    `quant_activations` (A's, B's): "int8" runs that side's quantized linears on int8 activations in
    the engine and in the NLL forward alike, so one w8/w4 folder against itself measures A8 vs A16.
    `kv_cache_dtype` (A's, B's): the engine's K/V cache (`auto`, `bfloat16`, `float32`, `int8`); it changes
    only the greedy continuations (decode steps read the cache; the NLL is a plain forward), so one folder
    against itself with B's `int8` measures the 8-bit cache's agreement."""
    # deferred: the engine and lmforge.quant load torch
    from lmforge.engine import LLM, SamplingParams
    from lmforge.eval.backends import a8_model
    from lmforge.quant import load_pretrained

    if suite.kind != "perplexity":
        raise ValueError(f"eval diff compares models item by item on a perplexity suite (text items); "
                         f"{suite.name} is a {suite.kind} suite: score each model with `lmforge eval run` "
                         f"(--quant-activations int8 for A8) and compare the runs with `lmforge eval compare`")

    run = RunDir(out, overwrite=overwrite)
    with run:
        run.write_config({"model_a": str(model_a), "model_b": str(model_b), "suite": suite.name,
                          "suite_sha256": suite.sha256, "dtype": dtype, "limit": limit,
                          "greedy_tokens": GREEDY_TOKENS, "quant_activations": list(quant_activations),
                          "kv_cache_dtype": list(kv_cache_dtype)})
        items = suite.items[:limit] if limit else suite.items
        llms = [LLM(str(m), dtype=dtype, device="cpu", quant_activations=qa, kv_cache_dtype=kv)
                for m, qa, kv in zip((model_a, model_b), quant_activations, kv_cache_dtype)]
        tok = llms[0].get_tokenizer()
        if tok is None:
            raise ValueError(f"{model_a}: no tokenizer files; eval diff needs a tokenizer")
        ids = [tok.encode(it["text"]) for it in items]
        prefixes = [_prefix(it, i, tok) for it, i in zip(items, ids)]
        params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
        conts = [[o.outputs[0] for o in llm.generate(prefixes, params, use_tqdm=False)] for llm in llms]
        del llms
        nlls = []
        for m, qa in zip((model_a, model_b), quant_activations):
            model = a8_model(m, dtype) if qa == "int8" else load_pretrained(m, dtype=dtype, device="cpu")
            nlls.append([_nll(model, i) for i in ids])
            del model
        rows = []
        for k, it in enumerate(items):
            ca, cb = conts[0][k], conts[1][k]
            row = {"id": it["id"], "category": it.get("category", "all"), "tokens": len(ids[k]) - 1,
                   "nll_a": round(nlls[0][k], 4), "nll_b": round(nlls[1][k], 4),
                   "same": ca.token_ids == cb.token_ids,
                   "agreement": _common_prefix(ca.token_ids, cb.token_ids) / GREEDY_TOKENS}
            if "answer" in it:
                row["correct_a"] = ca.text.strip().startswith(it["answer"])
                row["correct_b"] = cb.text.strip().startswith(it["answer"])
            rows.append(row)
        report = {"model_a": str(model_a), "model_b": str(model_b), "quant_activations": list(quant_activations),
                  "kv_cache_dtype": list(kv_cache_dtype), "suite": suite.name,
                  "suite_sha256": suite.sha256, "categories": _summarize(rows)}
        atomic_write_text(Path(out) / "per_sample.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
        atomic_write_json(Path(out) / "diff.json", report)
        atomic_write_text(Path(out) / "diff.md", diff_markdown(report))
        run.finish(**{c: {k: v for k, v in s.items()} for c, s in report["categories"].items()})
    return report


def _summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    cats: dict[str, list[dict]] = {}
    for r in rows:
        cats.setdefault(r["category"], []).append(r)
    cats["all"] = rows
    out = {}
    for c, rs in cats.items():
        n_tok = sum(r["tokens"] for r in rs)
        ppl_a = math.exp(sum(r["nll_a"] for r in rs) / n_tok)
        ppl_b = math.exp(sum(r["nll_b"] for r in rs) / n_tok)
        s = {"n": len(rs), "same": sum(r["same"] for r in rs), "changed": sum(not r["same"] for r in rs),
             "agreement": round(sum(r["agreement"] for r in rs) / len(rs), 4),
             "perplexity_a": round(ppl_a, 4), "perplexity_b": round(ppl_b, 4),
             "perplexity_change": round(ppl_b / ppl_a - 1, 5)}
        scored = [r for r in rs if "correct_a" in r]
        if scored:
            s.update(correct_a=sum(r["correct_a"] for r in scored), correct_b=sum(r["correct_b"] for r in scored),
                     newly_wrong=sum(r["correct_a"] and not r["correct_b"] for r in scored),
                     newly_right=sum(r["correct_b"] and not r["correct_a"] for r in scored))
        out[c] = s
    return out


def diff_markdown(report: dict[str, Any]) -> str:
    qa = report.get("quant_activations", ["none", "none"])
    kv = report.get("kv_cache_dtype", ["auto", "auto"])
    sides = [f"`{report[k]}`" + (" with int8 activations" if q == "int8" else "")
             + (f", {c} KV cache" if c != "auto" else "") for k, q, c in zip(("model_a", "model_b"), qa, kv)]
    lines = [f"# eval diff: {sides[0]} (A) vs {sides[1]} (B) on {report['suite']} "
             f"({report['suite_sha256'][:12]})", "",
             f"| category | n | same / changed | greedy agreement ({GREEDY_TOKENS} tok) | perplexity A | "
             "perplexity B | change | correct A / B | newly wrong / right |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c, s in report["categories"].items():
        right = f"{s['correct_a']} / {s['correct_b']}" if "correct_a" in s else "—"
        flips = f"{s['newly_wrong']} / {s['newly_right']}" if "correct_a" in s else "—"
        lines.append(f"| {c} | {s['n']} | {s['same']} / {s['changed']} | {s['agreement']:.3f} | "
                     f"{s['perplexity_a']:.3f} | {s['perplexity_b']:.3f} | {s['perplexity_change'] * 100:+.2f}% | "
                     f"{right} | {flips} |")
    return "\n".join(lines) + "\n"
