"""lmforge.eval without a model: metrics and their standard errors, suite files and the lock of
frozen built-ins, every task kind through mock backends, and `compare`. Runs in about a second.

    python -m pytest -q tests/test_eval_units.py
"""

from __future__ import annotations

import json
import math
import shutil
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmforge.eval import metrics as M
from lmforge.eval.backends import MockBackend, truncate_at_stop
from lmforge.eval.builtin import write_builtin_suites
from lmforge.eval.compare import SuiteChangedError, compare_runs
from lmforge.eval.evaluate import evaluate
from lmforge.eval.scoring import run_stability
from lmforge.eval.suites import make_perplexity_suite, write_suite
from lmforge.tasks.rng import SplitMix64
from lmforge.tasks.suite import BUILTIN_DIR, LOCK_FILE, SuiteError, builtin_names, load_suite, verify_builtin_suites
from lmforge.tasks.reasoning import DEFAULT_FORMAT, extract_last_match, normalize_answer
from lmforge.train.grpo.reward import correct_reward


@pytest.fixture(scope="module")
def suites():
    return [load_suite(name) for name in builtin_names()]


# ---- metrics ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("k,n", [(0, 10), (3, 10), (7, 9), (50, 100), (1, 2)])
def test_binary_stderr_is_lm_eval_formula(k, n):
    values = [1.0] * k + [0.0] * (n - k)
    p = k / n
    assert M.mean_stderr(values) == pytest.approx(math.sqrt(p * (1 - p) / (n - 1)), abs=1e-12)


@given(st.lists(st.floats(-1e3, 1e3), min_size=2, max_size=50))
def test_stderr_is_sample_std_over_sqrt_n(values):
    assert M.mean_stderr(values) == pytest.approx(statistics.stdev(values) / math.sqrt(len(values)), abs=1e-6)


def test_stderr_undefined_below_two():
    assert M.mean_stderr([1.0]) is None and M.mean_stderr([]) is None


def test_acc_norm_divides_by_characters():
    # Raw log-likelihood prefers the short choice; per character the long one wins.
    assert M.choice_predictions([-6.0, -8.0], ["ab", "abcdefgh"]) == (0, 1)
    assert M.choice_predictions([-1.0, -1.0], ["x", "y"]) == (0, 0)  # ties go to the first


def test_bits_per_byte_and_perplexity_formulas():
    nlls, toks, nbytes = [3.0, 5.0], [2, 4], [4, 6]
    m = M.perplexity_metrics(nlls, toks, nbytes)
    assert m["bits_per_byte"]["value"] == pytest.approx(8.0 / (math.log(2) * 10))
    assert m["token_perplexity"]["value"] == pytest.approx(math.exp(8.0 / 6))
    assert m["bits_per_byte"]["stderr"] > 0
    # Identical per-byte cost in every document: the ratio has no spread.
    assert M.perplexity_metrics([2.0, 4.0], [1, 2], [2, 4])["bits_per_byte"]["stderr"] == pytest.approx(0)


def test_answer_extraction_and_exact_match():
    assert extract_last_match(" 3 + 5 = 8, so the answer is 8.", r"-?\d+") == "8"
    assert extract_last_match(" 1,024 apples", r"-?\d+") == "1024"
    assert extract_last_match(" no idea", r"-?\d+") is None
    assert extract_last_match("x=-7", r"x=(-?\d+)") == "-7"
    assert M.score_output(" 42. ", "42", "exact_match", "") == (1.0, "42")
    assert M.score_output(" 42 apples", "42", "exact_match", "")[0] == 0.0
    assert truncate_at_stop(" 12\nQuestion: next", ["\n"]) == (" 12", True)


# Eval's exact_match/regex metrics had their own normaliser (trim, drop every comma, one trailing
# period) while rewards and the `answer` metric used the reasoning one, so a reward and an eval could
# score one answer differently. One rule set now (lmforge.tasks.reasoning.normalize_answer): these
# are the inputs where the two disagreed, with the answer every scorer now gives.
ONE_NORMALISER_WHERE_THE_TWINS_DISAGREED = [
    ("1,2", "1,2"),                      # old eval: "12" (every comma dropped, even between non-thousands)
    ("12,34", "12,34"),                  # old eval: "1234"
    ("Paris, France", "Paris, France"),  # old eval: "Paris France"
    ("007", "7"),                        # old eval: "007"
    ("12.0", "12"),                      # old eval: "12.0"
    ("+5", "5"),                         # old eval: "+5"
    ("$3", "3"),                         # old eval: "$3"
    ("$1,000.", "1000"),                 # old eval: "$1000"
    ("-0", "0"),                         # old eval: "-0"
    ("-0.0", "0"),                       # old eval: "-0.0"
    ("3.50", "3.5"),                     # old eval: "3.50"
    ("1,000.50", "1000.5"),              # old eval: "1000.50"
    ("0.10", "0.1"),                     # old eval: "0.10"
]


@pytest.mark.parametrize("text,canonical", ONE_NORMALISER_WHERE_THE_TWINS_DISAGREED)
def test_one_normalize_answer_for_rewards_and_every_eval_metric(text, canonical):
    assert normalize_answer(text) == canonical
    # exact_match, regex, the reasoning answer line and the GRPO reward all agree on it
    assert M.score_output(f" {text} ", canonical, "exact_match", "") == (1.0, canonical)
    assert M.score_output(DEFAULT_FORMAT.render("work", text), canonical, "answer", "") == (1.0, canonical)
    assert correct_reward(DEFAULT_FORMAT.render("work", text), {"answer": canonical}) == 1.0


def test_regex_metric_normalises_its_match_the_same_way():
    assert M.score_output(" so 007", "7", "regex", r"-?\d+") == (1.0, "7")
    assert M.score_output(" x=-0", "0", "regex", r"x=(-?\d+)") == (1.0, "0")
    assert M.score_output(" costs 1,000.50", "1000.5", "regex", r"\d+\.\d+") == (1.0, "1000.5")


# ---- suites and the freezing rule --------------------------------------------------------------------

def test_frozen_suites_match_the_lock():
    assert verify_builtin_suites() == []
    lock = json.loads((BUILTIN_DIR / LOCK_FILE).read_text())
    assert set(lock) == {"arith", "arith-stability", "choice-basics", "tiny-text", "arith-cot", "arith-cot-2d"}


def test_generators_reproduce_the_frozen_files(tmp_path):
    """A generator edited without a version bump (and regeneration) fails here."""
    write_builtin_suites(tmp_path)
    for name in builtin_names():
        assert (tmp_path / f"{name}.jsonl").read_bytes() == (BUILTIN_DIR / f"{name}.jsonl").read_bytes(), (
            f"builtin.py no longer generates the frozen {name}.jsonl: bump VERSIONS[{name!r}] and run "
            f"`lmforge eval make-suite builtins`")


def test_a_changed_frozen_file_fails_verification(tmp_path):
    for f in BUILTIN_DIR.iterdir():
        shutil.copy(f, tmp_path / f.name)
    path = tmp_path / "arith.jsonl"
    path.write_text(path.read_text().replace('"answer": "57"', '"answer": "58"', 1))
    problems = verify_builtin_suites(tmp_path)
    assert len(problems) == 1 and "arith" in problems[0] and "bump its version" in problems[0]


def test_builtin_contents(suites):
    by = {s.name: s for s in suites}
    assert by["arith"].n == 200 and by["arith"].kind == "generate"
    for it in by["arith"].items:  # every answer is the integer its question implies (spot-check one form)
        assert it["answer"].lstrip("-").isdigit()
    assert all(len(it["choices"]) == 4 for it in by["choice-basics"].items)
    assert len({it["answer"] for it in by["choice-basics"].items}) == 4  # the gold position varies
    assert by["arith-stability"].settings["samples"] == 5


def test_splitmix_is_fixed():
    rng = SplitMix64(0)
    assert [rng.next() for _ in range(2)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]  # reference values


@pytest.mark.parametrize("lines,msg", [
    (['{"suite": "x", "version": 1, "kind": "essay", "metric": "acc"}', '{"id": "a"}'], "kind 'essay'"),
    (['{"suite": "x", "version": 1, "kind": "generate", "metric": "acc"}', '{"id": "a"}'], "metric 'acc'"),
    (['{"suite": "x", "version": 1, "kind": "generate", "metric": "regex"}', '{"id": "a", "prompt": "p"}'],
     ":2: item lacks field 'answer'"),
    (['{"suite": "x", "version": 1, "kind": "choice", "metric": "acc"}',
      '{"id": "a", "prompt": "p", "choices": ["u", "v"], "answer": 2}'], "index of the correct choice"),
    (['{"suite": "x", "version": 1, "kind": "perplexity", "metric": "bits_per_byte"}',
      '{"id": "a", "text": "t"}', '{"id": "a", "text": "u"}'], ":3: duplicate id"),
    (['{"suite": "x", "version": "1", "kind": "perplexity", "metric": "bits_per_byte"}'], "'version' must be a int"),
    (['{"suite": "x", "version": 1, "kind": "perplexity", "metric": "bits_per_byte"}', '{oops'], ":2: not valid JSON"),
])
def test_bad_suite_files_name_line_and_field(tmp_path, lines, msg):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SuiteError, match="bad.jsonl"):
        load_suite(path)
    with pytest.raises(SuiteError) as e:
        load_suite(path)
    assert msg in str(e.value)


def test_unknown_suite_lists_builtins():
    with pytest.raises(SuiteError, match="arith"):
        load_suite("no-such-suite")


def test_make_perplexity_suite_is_deterministic(tmp_path):
    (tmp_path / "prep" / "splits").mkdir(parents=True)
    docs = [{"id": f"d{i}", "text": "" if i == 1 else f"Document {i}. " * 50, "meta": {}} for i in range(6)]
    (tmp_path / "prep" / "splits" / "val.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    a = make_perplexity_suite(tmp_path / "prep", tmp_path / "a.jsonl", max_docs=3, max_chars=100)
    b = make_perplexity_suite(tmp_path / "prep", tmp_path / "b.jsonl", max_docs=3, max_chars=100)
    assert a.sha256 == b.sha256 and a.name == "val-prep"
    assert [it["id"] for it in a.items] == ["d0", "d2", "d3"]  # empty documents skipped, file order kept
    assert all(len(it["text"]) <= 100 for it in a.items)


# ---- tasks through mock backends ---------------------------------------------------------------------

@pytest.mark.parametrize("correct", [True, False])
def test_mock_models_score_one_and_zero(tmp_path, suites, correct):
    results = evaluate(MockBackend(suites, correct=correct), suites, tmp_path / "run")
    t = results["tasks"]
    want = 1.0 if correct else 0.0
    assert t["arith"]["value"] == want and t["arith"]["n"] == 200
    assert t["choice-basics"]["metrics"]["acc"]["value"] == want
    assert t["choice-basics"]["metrics"]["acc_norm"]["value"] == want
    assert t["arith-stability"]["metrics"]["acc"]["value"] == want
    assert t["arith-stability"]["metrics"]["agreement"]["value"] == 1.0  # the mock always says the same
    assert t["arith-stability"]["metrics"]["score_spread"]["value"] == 0.0
    assert t["tiny-text"]["value"] == pytest.approx(1.0)  # the mock spends one bit per byte
    assert t["arith"]["stderr"] == 0.0
    samples = (tmp_path / "run" / "samples.jsonl").read_text().splitlines()
    bad = (tmp_path / "run" / "bad_cases.jsonl").read_text().splitlines()
    assert len(samples) == sum(s.n for s in suites)
    assert len(bad) == (0 if correct else 200 + 120 + 40 + 320 + 600)  # arith, choice, stability, arith-cot(-2d)
    record = json.loads((tmp_path / "run" / "record.json").read_text())
    assert record["status"] == "finished"
    assert record["inputs"]["suites"]["arith"]["sha256"] == t["arith"]["suite_sha256"] == load_suite("arith").sha256


class Scripted:
    """Answers item i's k-th sample from a table, to check the stability arithmetic by hand."""

    def __init__(self, table):
        self.table = table

    def generate(self, prompts, *, max_tokens, stop, temperature=0.0, n=1, seed=None):
        return [self.table[p] for p in prompts]


def test_stability_agreement_and_spread(tmp_path):
    header = {"suite": "s", "version": 1, "kind": "stability", "metric": "regex", "samples": 3}
    items = [{"id": "a", "prompt": "qa", "answer": "1"}, {"id": "b", "prompt": "qb", "answer": "2"}]
    suite = load_suite(write_suite(tmp_path / "s.jsonl", header, items))
    res = run_stability(suite, Scripted({"qa": [" 1", " 1", " 3"], "qb": [" 5", " 2", " nothing"]}))
    m = res.metrics
    assert m["agreement"]["value"] == pytest.approx((2 / 3 + 1 / 3) / 2)
    assert m["acc"]["value"] == pytest.approx((2 / 3 + 1 / 3) / 2)
    assert m["majority_acc"]["value"] == 1.0 / 2  # item a by majority; item b has no majority (ties -> first seen)
    run_acc = [0.5, 1.0, 0.0]  # the k-th sample of every item, as one run
    assert m["score_spread"]["value"] == pytest.approx(statistics.stdev(run_acc))


# ---- compare -----------------------------------------------------------------------------------------

def test_compare_refuses_changed_suites(tmp_path, suites):
    small = [load_suite("arith")]
    evaluate(MockBackend(small, True), small, tmp_path / "a", limit=10)
    evaluate(MockBackend(small, False), small, tmp_path / "b", limit=10)
    rows, changed = compare_runs(tmp_path / "a", tmp_path / "b")
    assert changed == [] and rows[0].delta == -1.0
    items = [{**it, "answer": "0"} if i == 0 else it for i, it in enumerate(small[0].items)]
    edited = load_suite(write_suite(tmp_path / "arith-edit.jsonl",
                                    {"suite": "arith", "version": 1, "kind": "generate", "metric": "regex"}, items))
    evaluate(MockBackend([edited], True), [edited], tmp_path / "c", limit=10)
    with pytest.raises(SuiteChangedError, match="--allow-changed-suite"):
        compare_runs(tmp_path / "a", tmp_path / "c")
    rows, changed = compare_runs(tmp_path / "a", tmp_path / "c", allow_changed_suite=True)
    assert changed == ["arith"] and all(r.suite_changed for r in rows)
