"""Scores and their standard errors. Pure functions of numbers and strings; no models here.
Answers are extracted and normalised by `lmforge.tasks.reasoning`, the one rule set rewards use too.

Standard error of a mean (`mean_stderr`) is the sample standard deviation (ddof=1) over
sqrt(n), as lm-evaluation-harness computes it (`sample_stddev(arr) / sqrt(len(arr))`). For
0/1 scores with mean p this is exactly sqrt(p (1 - p) / (n - 1)). With n < 2 it is undefined
and reported as None.

Perplexity-kind metrics are ratios of corpus totals, not means over documents:

    bits_per_byte    = sum NLL (nats) / (ln 2 * sum UTF-8 bytes)
    token_perplexity = exp(sum NLL / sum predicted tokens)

Their standard errors use the delta method for a ratio estimator R = sum x / sum y over
documents: se(R) = sqrt(sum (x_i - R y_i)^2 / (n - 1)) / (sqrt(n) * mean y); for the
perplexity, se = ppl * se(NLL per token). (lm-eval bootstraps these instead; the delta method
gives the same first-order answer without randomness.)
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from lmforge.tasks.reasoning import answers_match, extract_answer, extract_last_match, normalize_answer


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def mean_stderr(values: Sequence[float]) -> float | None:
    """Sample stderr of the mean: stdev(ddof=1) / sqrt(n) (== sqrt(p(1-p)/(n-1)) for 0/1 values)."""
    n = len(values)
    if n < 2:
        return None
    m = mean(values)
    var = sum((v - m) ** 2 for v in values) / (n - 1)
    return math.sqrt(var / n)


def ratio_stderr(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Delta-method stderr of R = sum(x) / sum(y) over paired per-document totals."""
    n = len(x)
    if n < 2 or sum(y) == 0:
        return None
    r, y_bar = sum(x) / sum(y), sum(y) / n
    resid = sum((xi - r * yi) ** 2 for xi, yi in zip(x, y)) / (n - 1)
    return math.sqrt(resid / n) / y_bar


def bits_per_byte(nll_nats: float, n_bytes: int) -> float:
    return nll_nats / (math.log(2) * n_bytes)


def perplexity_metrics(nlls: Sequence[float], n_tokens: Sequence[int], n_bytes: Sequence[int]) -> dict[str, dict]:
    """Corpus metrics from per-document totals: NLL in nats, predicted tokens, UTF-8 bytes."""
    total_nll, total_tok, total_bytes = sum(nlls), sum(n_tokens), sum(n_bytes)
    bpb = bits_per_byte(total_nll, total_bytes)
    bpb_se = ratio_stderr(nlls, [b * math.log(2) for b in n_bytes])
    nll_tok = total_nll / total_tok
    nll_tok_se = ratio_stderr(nlls, n_tokens)
    ppl = math.exp(nll_tok)
    return {"bits_per_byte": {"value": bpb, "stderr": bpb_se},
            "token_perplexity": {"value": ppl, "stderr": None if nll_tok_se is None else ppl * nll_tok_se},
            "nll_per_token": {"value": nll_tok, "stderr": nll_tok_se},
            "tokens": {"value": total_tok, "stderr": None}, "bytes": {"value": total_bytes, "stderr": None}}


def score_output(output: str, answer: str, metric: str, pattern: str) -> tuple[float, str | None]:
    """(1.0 or 0.0, the answer the output gives) under `exact_match` (the whole output), `regex` (the last
    match of `pattern`) or `answer` (the reasoning format's one answer line: the extractor rewards use
    too). All three compare through the one `normalize_answer` (`lmforge.tasks.reasoning`)."""
    if metric == "answer":
        given = extract_answer(output)
    elif metric == "exact_match":
        given = normalize_answer(output)
    else:
        given = extract_last_match(output, pattern)
    return float(answers_match(given, answer)), given


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. (2021)'s unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def choice_predictions(loglikelihoods: Sequence[float], choices: Sequence[str]) -> tuple[int, int]:
    """(argmax log-likelihood, argmax log-likelihood per character of the choice), lm-eval's acc and
    acc_norm: the normalizer is len(choice) in characters, not tokens, so it does not depend on the
    tokenizer. Ties go to the first choice."""
    norm = [ll / len(c) for ll, c in zip(loglikelihoods, choices)]
    return _argmax(loglikelihoods), _argmax(norm)


def _argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))


def agreement(answers: Sequence[str | None]) -> tuple[float, str | None]:
    """(share of samples that give the most common answer, that answer); no answer counts as its own."""
    counts = Counter(answers)
    top, c = max(counts.items(), key=lambda kv: (kv[1], kv[0] is not None))
    return c / len(answers), top


def sample_std(values: Sequence[float]) -> float | None:
    n = len(values)
    if n < 2:
        return None
    m = mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))


# ---- repetition in generated text ----------------------------------------------------------
# The symptom "the model repeats itself" made countable (the training seed's troubleshooting row):
# distinct-n (Li et al. 2016) over all outputs, and the repeated n-gram rate within each output
# (the share of its n-grams that already occurred earlier in the same text). Words are
# whitespace-separated, so the figures do not depend on a tokenizer.


def ngrams(words: Sequence[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]


def distinct_n(texts: Sequence[str], n: int) -> float | None:
    """Unique n-grams / all n-grams, pooled over `texts` (1.0: nothing repeats); None without n-grams."""
    grams = [g for t in texts for g in ngrams(t.split(), n)]
    return len(set(grams)) / len(grams) if grams else None


def repeated_ngram_rate(text: str, n: int = 3) -> float | None:
    """Share of the text's n-grams seen earlier in the same text (0.0: none; → 1 for a loop)."""
    grams = ngrams(text.split(), n)
    if not grams:
        return None
    seen: set[tuple[str, ...]] = set()
    repeats = 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams)


def repetition_metrics(texts: Sequence[str], n: int = 3) -> dict[str, dict]:
    """distinct_1, distinct_2 and rep_{n}gram (the mean per-output repeated n-gram rate), in the metrics' shape.
    Outputs too short for an n-gram repeat nothing: they count as distinct 1.0 and rate 0.0."""
    rates = [r if r is not None else 0.0 for r in (repeated_ngram_rate(t, n) for t in texts)]
    out = {}
    for k in (1, 2):
        d = distinct_n(texts, k)
        out[f"distinct_{k}"] = {"value": 1.0 if d is None else d, "stderr": None}
    out[f"rep_{n}gram"] = {"value": mean(rates) if rates else 0.0, "stderr": mean_stderr(rates)}
    return out
