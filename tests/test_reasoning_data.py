"""Reasoning data and eval: synthetic tasks whose steps are right, train/eval disjointness, users' task
files (GSM8K's '#### N'), the chat template's reasoning, digit splitting, SFT on task rows, the
arith-cot suite, pass@k / maj@k / per-category accuracy, and distillation's rejection sampling."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from lmforge.data.synth import TaskFileError, eval_prompts, read_tasks, write_synth
from lmforge.eval.scoring import run_generate
from lmforge.eval.suites import write_suite
from lmforge.tasks.arith_cot import CATEGORIES_2D, EVAL_SEEDS, TASKS, synth_rows
from lmforge.tasks.reasoning import DEFAULT_FORMAT, ReasoningFormat
from lmforge.tasks.suite import load_suite

sys.path.insert(0, str(Path(__file__).parent))

EQUATION = re.compile(r"^(\d+)([+\-*])(\d+)=(\d+)$")


def _check_steps(row: dict) -> None:
    """Every 'a op b = c' line holds, the per-digit lines' arithmetic holds, the last equation is the answer."""
    last = None
    for line in row["reasoning"].splitlines():
        m = EQUATION.match(line)
        if m:
            a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
            assert {"+": a + b, "-": a - b, "*": a * b}[op] == c, (row["prompt"], line)
            last = c
        elif "=" in line and "->" in line:  # a column: "4+8+1=13 -> 32", "14-8-0=6 borrow 1 -> 6", "7*6+4=46 -> 62"
            lhs, rhs = line.split("=")
            assert re.fullmatch(r"[\d+\-*]+", lhs), line
            assert eval(lhs) == int(rhs.split()[0]), (row["prompt"], line)  # digits and + - * only
    assert str(last) == row["answer"], row


@pytest.mark.parametrize("task", sorted(TASKS))
def test_synth_steps_are_right(task):
    rows, counts = synth_rows(task, 120, seed=11)
    assert counts["rows"] == 120 and len({r["prompt"] for r in rows}) == 120
    for r in rows:
        _check_steps(r)
        assert set(r) >= {"prompt", "answer", "reasoning", "category", "difficulty", "text"}
        assert DEFAULT_FORMAT.extract(r["text"]) == r["answer"] and DEFAULT_FORMAT.is_well_formed(
            DEFAULT_FORMAT.render(r["reasoning"], r["answer"]))
    again, _ = synth_rows(task, 120, seed=11)
    assert again == rows  # the same seed, the same rows


def test_train_and_eval_are_disjoint(tmp_path):
    prompts, shas = eval_prompts()
    assert len(prompts) == 920  # arith-cot and arith-cot-2d, which share no prompt
    assert shas == {name: load_suite(name).sha256 for name in ("arith-cot", "arith-cot-2d")}
    rec = write_synth("mix", 3000, 5, tmp_path / "train.jsonl")
    train = {json.loads(x)["prompt"] for x in (tmp_path / "train.jsonl").read_text().splitlines()}
    assert not train & prompts and rec["eval_overlap_after"] == 0 and rec["eval_prompts_checked"] == 920
    assert rec["eval_suites"] == shas
    assert rec["dropped_eval_overlap"] > 0  # small categories (2-digit sums) do collide: the filter works
    assert json.loads((tmp_path / "train.jsonl.record.json").read_text())["sha256"] == rec["sha256"]
    for seed in EVAL_SEEDS:
        with pytest.raises(ValueError, match="eval suite's seed"):
            write_synth("mix", 10, seed, tmp_path / "x.jsonl")
    with pytest.raises(FileExistsError):
        write_synth("mix", 10, 5, tmp_path / "train.jsonl")


def test_read_tasks_gsm8k_and_errors(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps({"question": "Tom has 3 bags of 400 apples. How many?", "answer": "3*400=1200\n#### 1,200"})
                 + "\n\n" + json.dumps({"prompt": "2+2?", "answer": 4, "category": "tiny"}) + "\n")
    a, b = read_tasks(f)
    assert a == {"prompt": "Tom has 3 bags of 400 apples. How many?", "answer": "1,200", "reasoning": "3*400=1200",
                 "category": "all"}
    assert b["answer"] == "4" and b["reasoning"] is None and b["category"] == "tiny"
    f.write_text('{"prompt": "x"}\n')
    with pytest.raises(TaskFileError, match=r"t.jsonl:1: field 'answer'"):
        read_tasks(f)
    f.write_text('{"answer": "1"}\nnot json\n')
    with pytest.raises(TaskFileError, match=r"t.jsonl:1: field 'prompt'"):
        read_tasks(f)


def test_reasoning_format_is_configurable():
    fmt = ReasoningFormat("<reason>", "</reason>", "Final:")
    text = fmt.render("1+1=2", "2")
    assert text == "<reason>\n1+1=2\n</reason>\nFinal: 2" and fmt.is_well_formed(text) and fmt.extract(text) == "2"
    assert DEFAULT_FORMAT.extract(text) is None


def test_habit_tells_worked_steps_from_a_bare_answer():
    assert DEFAULT_FORMAT.habit(DEFAULT_FORMAT.render("4+1+0=5 -> 5", "5")) == "steps"
    assert DEFAULT_FORMAT.habit(DEFAULT_FORMAT.render("", "5")) == "direct"  # an empty think block
    assert DEFAULT_FORMAT.habit("<think>\n4+1") == "none" and DEFAULT_FORMAT.habit("Answer: 5") == "none"
    assert ReasoningFormat("<reason>", "</reason>", "Final:").habit("<reason>\n\n</reason>\nFinal: 2") == "direct"


def test_chat_template_renders_reasoning_and_digits_split(tmp_path):
    from lmforge.tokenizer import load_tokenizer, train_tokenizer
    from lmforge.tokenizer.chat import render_chat
    from lmforge.train.sft_data import SFTLoader, task_messages

    rows, _ = synth_rows("mix", 200, seed=3)
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train_tokenizer([str(tmp_path / "t.jsonl")], tmp_path / "tok", vocab_size=320, show_progress=False)
    tok = load_tokenizer(tmp_path / "tok")
    assert tok.tokenize("12345") == ["1", "2", "3", "4", "5"]  # one token per digit, whatever the merges
    msgs = [{"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "Answer: 5", "reasoning_content": "2+3+0=5 -> 5\n2+3=5"}]
    jinja = tok.apply_chat_template(msgs, tokenize=False)
    assert jinja == render_chat(msgs) and DEFAULT_FORMAT.render("2+3+0=5 -> 5\n2+3=5", "5") in jinja
    # a task row becomes the same conversation as its rendered form; loss only on the assistant turn
    loader = SFTLoader(tmp_path / "t.jsonl", tok, seq_len=256, batch_size=2, packed=False)
    first = task_messages(rows[0], "t.jsonl:1")
    assert first[1]["content"] == DEFAULT_FORMAT.render(rows[0]["reasoning"], rows[0]["answer"])
    ids = tok.encode(render_chat(first), add_special_tokens=False)
    conv = loader._conversations[0]
    assert conv.ids.tolist() == ids
    learned = tok.decode([i for i, m in zip(conv.ids.tolist(), conv.loss_mask.tolist()) if m])
    assert learned == first[1]["content"] + "<|im_end|>"


class Scripted:
    """k outputs per prompt from a table; records whether the chat template was asked for."""

    def __init__(self, table):
        self.table, self.chat = table, None

    def generate(self, prompts, *, max_tokens, stop, temperature=0.0, n=1, seed=None, chat=False):
        self.chat = chat
        return [self.table[p][:n] for p in prompts]


def test_generate_suite_pass_at_k_maj_at_k_and_categories(tmp_path):
    def ans(x):
        return DEFAULT_FORMAT.render("...", x)

    header = {"suite": "s", "version": 1, "kind": "generate", "metric": "answer", "chat": True, "samples": 3,
              "temperature": 0.7, "max_tokens": 300, "stop": []}
    items = [{"id": "a", "prompt": "qa", "answer": "1,000", "category": "add"},
             {"id": "b", "prompt": "qb", "answer": "2", "category": "add"},
             {"id": "c", "prompt": "qc", "answer": "3", "category": "mul"}]
    suite = load_suite(write_suite(tmp_path / "s.jsonl", header, items))
    backend = Scripted({"qa": [ans("1000.0"), ans("7"), ans("1000")],  # 2/3 right, majority right
                        "qb": [ans("5"), ans("2"), "Answer: 2\nAnswer: 2"],  # 1/3 (two answer lines: none)
                        "qc": [ans("4"), ans("4"), ans("4")]})
    res = run_generate(suite, backend)
    m = res.metrics
    assert backend.chat is True
    assert m["acc"]["value"] == pytest.approx((2 / 3 + 1 / 3 + 0) / 3)
    assert m["pass@3"]["value"] == pytest.approx(2 / 3) and m["maj@3"]["value"] == pytest.approx(1 / 3)
    assert m["acc/add"]["value"] == pytest.approx(0.5) and m["acc/mul"]["value"] == 0.0


def test_arith_cot_is_frozen_with_categories():
    s = load_suite("arith-cot")
    assert s.n >= 300 and s.metric == "answer" and s.settings["chat"] and s.settings["max_tokens"] >= 256
    cats = {}
    for it in s.items:
        cats[it["category"]] = cats.get(it["category"], 0) + 1
    assert cats == {c: 40 for c in TASKS["mix"]}


def test_arith_cot_2d_is_frozen_disjoint_and_larger_per_category():
    s, whole = load_suite("arith-cot-2d"), load_suite("arith-cot")
    assert s.metric == "answer" and s.settings["chat"] and s.settings["max_tokens"] == whole.settings["max_tokens"]
    cats = {}
    for it in s.items:
        cats[it["category"]] = cats.get(it["category"], 0) + 1
    assert cats == {c: 200 for c in CATEGORIES_2D}
    assert not {it["prompt"] for it in s.items} & {it["prompt"] for it in whole.items}
    assert len({it["prompt"] for it in s.items}) == 600


def test_distill_keeps_only_correct_traces(tmp_path, monkeypatch):
    """The engine is replaced by a scripted one: this checks the rejection rule and the counts, which
    depend only on the texts the teacher writes."""
    import lmforge.engine as engine
    import lmforge.train.distill as distill_module
    from lmforge.train.distill import distill
    from reasoning_fixtures import tiny_model, write_tasks

    tasks = write_tasks(tmp_path / "tasks.jsonl", n=3)
    model = tiny_model(tmp_path, tasks)
    rows = [json.loads(x) for x in tasks.read_text().splitlines()]

    class Out:
        def __init__(self, texts):
            self.outputs = [type("C", (), {"text": t})() for t in texts]

    class FakeLLM(engine.LLM):
        def generate(self, prompts, params, use_tqdm=True):
            a = [r["answer"] for r in rows]
            return [Out([DEFAULT_FORMAT.render("ok", a[0]), DEFAULT_FORMAT.render("no", "0")]),
                     Out([f"Answer: {a[1]}", DEFAULT_FORMAT.render("ok", a[1])]),  # malformed but right, then kept
                     Out(["nothing", "<think>\n</think>\nAnswer: 1\nAnswer: 2"])]

    monkeypatch.setattr(distill_module, "LLM", FakeLLM)  # where distill looks it up
    res = distill(model, tasks, 2, tmp_path / "d", dtype="float32")
    kept = [json.loads(x) for x in (tmp_path / "d" / "sft.jsonl").read_text().splitlines()]
    assert [k["task"] for k in kept] == [0, 1]
    assert all(DEFAULT_FORMAT.extract(k["messages"][1]["content"]) == rows[k["task"]]["answer"] for k in kept)
    assert (res["samples"], res["kept"], res["wrong"], res["malformed"], res["correct"]) == (6, 2, 1, 3, 3)
    assert res["kept"] + res["wrong"] + res["malformed"] == res["samples"]
    assert res["teacher_accuracy"] == pytest.approx(3 / 6) and res["teacher_pass@2"] == pytest.approx(2 / 3)
    assert res["kept_fraction"] == pytest.approx(2 / 6)


def test_distill_on_ray_replicas_keeps_the_same_traces_as_one_engine(tmp_path):
    """`lmforge distill --executor ray --replicas 2`: the teacher's traces come from `lmforge generate`'s Ray
    path, with the same prompts, per-task seeds and budget, so the kept SFT rows are the same bytes."""
    import ray  # the optional extra, which `make test` installs

    from lmforge.train.distill import distill
    from reasoning_fixtures import tiny_model, write_tasks

    tasks = write_tasks(tmp_path / "tasks.jsonl", n=4)
    model = tiny_model(tmp_path, tasks)
    common = dict(temperature=0.8, max_tokens=24, seed=3, dtype="float32", device="cpu")
    local = distill(model, tasks, 2, tmp_path / "local", **common)
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        on_ray = distill(model, tasks, 2, tmp_path / "ray", executor="ray", replicas=2, **common)
    finally:
        ray.shutdown()
    assert (tmp_path / "ray" / "sft.jsonl").read_bytes() == (tmp_path / "local" / "sft.jsonl").read_bytes()
    assert {k: on_ray[k] for k in ("samples", "kept", "wrong", "malformed", "correct")} == \
        {k: local[k] for k in ("samples", "kept", "wrong", "malformed", "correct")}
