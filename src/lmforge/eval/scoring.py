"""One scoring function per suite kind: items in, metrics + per-item samples out.

Each returns a `TaskResult`: `metrics` ({name: {"value", "stderr"}}), `samples` (one dict per
item: id, prompt, target, output, score, plus kind-specific fields) and `bad_cases` (the
samples that failed, for review). A task asks its backend for texts and log-likelihoods
only; it knows nothing about tokens, devices or output files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmforge.eval import metrics as M
from lmforge.eval.backends import Backend
from lmforge.tasks.reasoning import normalize_answer
from lmforge.tasks.suite import Suite


@dataclass
class TaskResult:
    metrics: dict[str, dict[str, Any]]
    primary: str  # the metric a comparison leads with
    samples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def bad_cases(self) -> list[dict[str, Any]]:
        return [s for s in self.samples if s.get("failed")]


def _stat(values: list[float]) -> dict[str, Any]:
    return {"value": M.mean(values), "stderr": M.mean_stderr(values)}


def run_perplexity(suite: Suite, backend: Backend) -> TaskResult:
    texts = [it["text"] for it in suite.items]
    scored = backend.rolling_nll(texts)
    n_bytes = [len(t.encode("utf-8")) for t in texts]
    samples = [{"id": it["id"], "prompt": it["text"], "target": None, "output": None,
                "score": M.bits_per_byte(nll, b), "nll": nll, "tokens": n, "bytes": b, "failed": False}
               for it, (nll, n), b in zip(suite.items, scored, n_bytes)]
    return TaskResult(M.perplexity_metrics([s["nll"] for s in samples], [s["tokens"] for s in samples], n_bytes),
                      "bits_per_byte", samples)


def run_generate(suite: Suite, backend: Backend) -> TaskResult:
    """Greedy (samples 1) or k samples at `temperature` per item. Metrics: the primary accuracy (greedy:
    the one output; k samples: pass@1, the mean over samples), `pass@k` and `maj@k` (the most common
    extracted answer is right) when k > 1, and `acc/<category>` for items that carry a category."""
    cfg, k = suite.settings, suite.settings["samples"]
    extra = {"chat": True} if cfg["chat"] else {}  # backends without chat support keep working
    sampled = k > 1 or cfg["temperature"] > 0
    outputs = backend.generate([it["prompt"] for it in suite.items], max_tokens=cfg["max_tokens"], stop=cfg["stop"],
                               temperature=cfg["temperature"] if sampled else 0.0, n=k,
                               **({"seed": cfg["seed"]} if sampled else {}), **extra)
    samples = []
    for it, outs in zip(suite.items, outputs):
        scored = [M.score_output(o, it["answer"], suite.metric, cfg["answer_regex"]) for o in outs]
        s = {"id": it["id"], "prompt": it["prompt"], "target": it["answer"], "output": outs[0],
             "extracted": scored[0][1], "score": M.mean([x for x, _ in scored]), "category": it.get("category")}
        if k > 1:
            _, majority = M.agreement([g for _, g in scored])
            s.update(outputs=outs, extracted_all=[g for _, g in scored],
                     pass_at_k=M.pass_at_k(k, int(sum(x for x, _ in scored)), k),
                     maj_at_k=float(majority is not None and majority == normalize_answer(it["answer"])))
        s["failed"] = s["score"] < 1
        samples.append(s)
    name = "exact_match" if suite.metric == "exact_match" else "acc"
    metrics = {name: _stat([s["score"] for s in samples])}
    if k > 1:
        metrics[f"pass@{k}"] = _stat([s["pass_at_k"] for s in samples])
        metrics[f"maj@{k}"] = _stat([s["maj_at_k"] for s in samples])
    for cat in sorted({s["category"] for s in samples if s["category"] is not None}):
        metrics[f"{name}/{cat}"] = _stat([s["score"] for s in samples if s["category"] == cat])
    metrics.update(M.repetition_metrics([o for outs in outputs for o in outs]))  # "the model repeats itself"
    return TaskResult(metrics, name, samples)


def run_choice(suite: Suite, backend: Backend) -> TaskResult:
    delim = suite.settings["target_delimiter"]
    requests = [(it["prompt"], delim + c) for it in suite.items for c in it["choices"]]
    lls = iter(backend.loglikelihood(requests))
    samples = []
    for it in suite.items:
        ll = [next(lls) for _ in it["choices"]]
        pred, pred_norm = M.choice_predictions(ll, it["choices"])
        acc, acc_norm = float(pred == it["answer"]), float(pred_norm == it["answer"])
        samples.append({"id": it["id"], "prompt": it["prompt"], "target": it["choices"][it["answer"]],
                        "output": it["choices"][pred], "output_norm": it["choices"][pred_norm],
                        "choices": it["choices"], "loglikelihoods": ll, "score": acc, "acc_norm": acc_norm,
                        "failed": acc < 1 or acc_norm < 1})
    return TaskResult({"acc": _stat([s["score"] for s in samples]),
                       "acc_norm": _stat([s["acc_norm"] for s in samples])}, "acc", samples)


def run_stability(suite: Suite, backend: Backend) -> TaskResult:
    """K samples per item at temperature T. Per item: agreement = share of the K samples giving the
    most common answer, score = share correct. Over the suite: the mean of each (stderr over items),
    majority-vote accuracy, and `score_spread`, the sample std of the K run-level accuracies (run k
    = every item's k-th sample): how much one evaluation at this temperature can move by chance."""
    cfg, k = suite.settings, suite.settings["samples"]
    outputs = backend.generate([it["prompt"] for it in suite.items], max_tokens=cfg["max_tokens"], stop=cfg["stop"],
                               temperature=cfg["temperature"], n=k, seed=cfg["seed"])
    samples, runs = [], [[] for _ in range(k)]
    for it, outs in zip(suite.items, outputs):
        scored = [M.score_output(o, it["answer"], suite.metric, cfg["answer_regex"]) for o in outs]
        answers = [g for _, g in scored]
        agree, majority = M.agreement(answers)
        for j, (s, _) in enumerate(scored):
            runs[j].append(s)
        score = M.mean([s for s, _ in scored])
        maj_correct = float(majority is not None and majority == normalize_answer(it["answer"]))
        samples.append({"id": it["id"], "prompt": it["prompt"], "target": it["answer"], "output": outs,
                        "extracted": answers, "score": score, "agreement": agree, "majority": majority,
                        "majority_correct": maj_correct, "failed": score < 1})
    run_acc = [M.mean(r) for r in runs]
    return TaskResult({"agreement": _stat([s["agreement"] for s in samples]),
                       "acc": _stat([s["score"] for s in samples]),
                       "majority_acc": _stat([s["majority_correct"] for s in samples]),
                       "score_spread": {"value": M.sample_std(run_acc), "stderr": None},
                       "run_acc_min": {"value": min(run_acc), "stderr": None},
                       "run_acc_max": {"value": max(run_acc), "stderr": None}}, "agreement", samples)


RUNNERS = {"perplexity": run_perplexity, "generate": run_generate, "choice": run_choice, "stability": run_stability}


def run_task(suite: Suite, backend: Backend) -> TaskResult:
    return RUNNERS[suite.kind](suite, backend)
