"""Users' own task files through SFT, GRPO and eval: a GSM8K-style JSONL (`question`, `answer` ending in
`#### N`) and a plain prompt/answer JSONL, read by the one reader (`lmforge.data.synth.read_tasks`) and scored by
the one answer normaliser in GRPO's reward and in eval (`--suite FILE`, hashed like a built-in suite)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from reasoning_fixtures import tiny_model, write_tasks  # noqa: E402

from lmforge.config import load_config  # noqa: E402
from lmforge.eval.backends import MockBackend  # noqa: E402
from lmforge.eval.evaluate import evaluate  # noqa: E402
from lmforge.eval.metrics import score_output  # noqa: E402
from lmforge.eval.user_tasks import is_task_file, load_any_suite, make_task_suite  # noqa: E402
from lmforge.tasks.reasoning import DEFAULT_FORMAT  # noqa: E402
from lmforge.tokenizer.load import load_tokenizer  # noqa: E402
from lmforge.train.config import TrainConfig  # noqa: E402
from lmforge.train.grpo.reward import Rewards  # noqa: E402
from lmforge.train.sft_data import IGNORE_INDEX, SFTLoader  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")
GSM8K = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72"},
    {"question": "A shop sells 250 pens a day. How many pens does it sell in 4 days?",
     "answer": "250 * 4 = <<250*4=1000>>1000\n#### 1,000"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
                 "How much did she earn?",
     "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
               "$<<0.2*50=10>>10.\n#### 10"},
    {"question": "What is 7 - 9?", "answer": "7 - 9 = -2\n#### -2"},
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("user-tasks")
    gsm = root / "gsm8k.jsonl"
    gsm.write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    plain = root / "plain.jsonl"
    plain.write_text("".join(json.dumps({"prompt": r["question"], "answer": r["answer"].rpartition("####")[2].strip()})
                             + "\n" for r in GSM8K))
    model = tiny_model(root, write_tasks(root / "synth.jsonl", n=32))
    return root, gsm, plain, model


def test_sft_renders_gsm8k_steps_and_final_answer(setup):
    root, gsm, _, model = setup
    tok = load_tokenizer(model)
    loader = SFTLoader(gsm, tok, seq_len=512, batch_size=1, packed=False)
    assert loader.stats.conversations == 4
    targets = []
    for _ in range(4):
        b = next(loader)
        labels = b["labels"][0]
        targets.append(tok.decode(labels[labels != IGNORE_INDEX].tolist()))
    text = "\n".join(targets)
    assert "Answer: 72" in text and "Answer: 1,000" in text and "<<48/2=24>>24 clips" in text
    assert "How many clips" not in text  # the question is the user's turn: no loss on it
    plain = SFTLoader(setup[2], tok, seq_len=512, batch_size=1, packed=False, seed=1)  # no traces: empty think
    targets = set()
    for _ in range(4):
        labels = next(plain)["labels"][0]
        targets.add(tok.decode(labels[labels != IGNORE_INDEX].tolist()))
    assert DEFAULT_FORMAT.render("", "72") + "<|im_end|>" in targets
    assert DEFAULT_FORMAT.is_well_formed(DEFAULT_FORMAT.render("", "72"))  # GRPO's format reward accepts it


def test_reward_and_eval_score_an_answer_the_same_way(setup):
    _, gsm, plain, _ = setup
    suite = load_any_suite(gsm)
    rewards = Rewards(["format", "correct"], [1.0, 1.0])
    outputs = {"72": 1, "1000": 1, "10.00": 1, "-2": 1}  # 1,000 = 1000; $10 = 10.00: one normaliser
    wrong = {"73": 0, "1001": 0, "ten": 0, "2": 0}
    for table in (outputs, wrong):
        completions = [DEFAULT_FORMAT.render("steps", a) for a in table]
        parts, _ = rewards(completions, [{"answer": it["answer"]} for it in suite.items])
        scores = [score_output(c, it["answer"], suite.metric, "")[0] for c, it in zip(completions, suite.items)]
        assert parts["correct"] == scores == [float(v) for v in table.values()]
    assert [it["answer"] for it in load_any_suite(plain).items] == [it["answer"] for it in suite.items]


def test_a_task_file_is_a_hashed_suite_and_freezes(setup, tmp_path):
    _, gsm, plain, _ = setup
    assert is_task_file(gsm) and is_task_file(plain)
    suite = load_any_suite(gsm)
    assert suite.sha256 == hashlib.sha256(gsm.read_bytes()).hexdigest() and suite.n == 4
    assert (suite.kind, suite.metric, suite.settings["chat"]) == ("generate", "answer", True)
    for correct, value in ((True, 1.0), (False, 0.0)):
        res = evaluate(MockBackend([suite], correct=correct), [suite], tmp_path / f"mock-{correct}")
        task = res["tasks"]["gsm8k"]
        assert task["value"] == value and task["suite_sha256"] == suite.sha256
    frozen = make_task_suite(gsm, tmp_path / "gsm8k-suite.jsonl", max_tokens=8)
    assert not is_task_file(frozen.path) and frozen.items == suite.items and frozen.settings["max_tokens"] == 8
    assert json.loads(frozen.path.read_text().splitlines()[0])["source_sha256"] == suite.sha256
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "steps #### "}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: field 'answer' has nothing after '####'"):
        load_any_suite(bad)


def test_eval_cli_on_a_gsm8k_file(setup, tmp_path):
    _, gsm, _, model = setup
    from typer.testing import CliRunner

    from lmforge.cli import app

    out = tmp_path / "eval"
    res = CliRunner().invoke(app, ["eval", str(model), "--suite", str(gsm), "--limit", "1", "--out", str(out)])
    assert res.exit_code == 0, res.output
    res = json.loads((out / "results.json").read_text())["tasks"]["gsm8k"]
    assert res["n"] == 1 and res["suite_n"] == 4 and res["kind"] == "generate"
    assert res["suite_sha256"] == hashlib.sha256(gsm.read_bytes()).hexdigest()


def test_grpo_trains_on_a_gsm8k_file(setup, tmp_path):
    from lmforge.train.grpo.trainer import train_grpo

    _, gsm, _, model = setup
    cfg = load_config(TrainConfig, ROOT / "configs/grpo.yaml", [
        f"model.init={model}", f"data.path={gsm}", "train.max_steps=1", "train.log_every=0", "train.ckpt_every=0",
        "grpo.prompts_per_step=2", "grpo.group_size=2", "grpo.max_tokens=8"])
    rec = train_grpo(cfg, tmp_path / "grpo")
    assert rec["status"] == "finished" and rec["num_tasks"] == 4
    assert rec["data_hash"] == hashlib.sha256(gsm.read_bytes()).hexdigest()


def test_sft_pads_with_a_hugging_face_tokenizer_s_own_token():
    """A pretrained model's tokenizer (Qwen2.5's) has no <|pad|>: SFT pads with its pad or EOS token."""
    from lmforge.train.sft_data import pad_id

    class QwenLike:
        unk_token_id, pad_token_id, eos_token_id = None, None, 151645

        def convert_tokens_to_ids(self, token):
            return None

    assert pad_id(QwenLike()) == 151645
    QwenLike.pad_token_id = 151643
    assert pad_id(QwenLike()) == 151643
