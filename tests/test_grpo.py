"""GRPO: the objective against hand-computed values, rewards on edge cases, engine log-probs = trainer
log-probs, the engine following the trainer's weights, and an exact resume after SIGKILL.

A tiny random model (2 layers, hidden 32) with a tokenizer trained on synthetic tasks; one thread
(tiny matmuls are slower with OpenMP workers on a busy machine)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lmforge.config import ConfigError, load_config
from lmforge.tasks.reasoning import DEFAULT_FORMAT, extract_answer, normalize_answer
from lmforge.train.config import TrainConfig
from lmforge.train.grpo.loss import grpo_loss, group_advantages, kl_k3
from lmforge.train.grpo.reward import Rewards, correct_reward, format_reward

sys.path.insert(0, str(Path(__file__).parent))
from reasoning_fixtures import tiny_model, write_tasks  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]


# ---- the objective by hand ----------------------------------------------------------------------------

def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 2.0, 1.0, 3.0, 3.0])  # two groups of 3
    adv = group_advantages(r, 3, scale=False)
    assert adv.tolist() == pytest.approx([0.0, -1.0, 1.0, -1 / 3, 2 / 3, 2 / 3][:3] + [(1 - 7 / 3), (3 - 7 / 3), (3 - 7 / 3)])
    scaled = group_advantages(r, 3, scale=True, eps=0.0)
    std0 = math.sqrt(((0) ** 2 + 1 + 1) / 2)  # unbiased std of [1, 0, 2] = 1
    assert scaled[:3].tolist() == pytest.approx([0.0, -1 / std0, 1 / std0])
    assert group_advantages(torch.tensor([2.0, 2.0]), 2).tolist() == [0.0, 0.0]  # a tied group teaches nothing


def test_clipped_loss_and_kl_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.75, 0.5], [0.25, 0.5]]))  # ratios 1.5, 1 / 0.5, 1
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[True, True], [True, False]])
    loss, st = grpo_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # row 0: -min(1.5, 1.2) = -1.2, -min(1, 1) = -1; row 1: -min(-0.5, -0.8) = 0.8 (masked token ignored)
    assert float(loss) == pytest.approx((-1.2 - 1.0 + 0.8) / 3)
    assert float(st["clipped"]) == 2 and float(st["tokens"]) == 3  # 1.5 with A>0, 0.5 with A<0
    seq, _ = grpo_loss(new, old, adv, mask, 0.2, 0.2, agg="sequence")
    assert float(seq) == pytest.approx(((-1.2 - 1.0) / 2 + 0.8) / 2)
    dr, _ = grpo_loss(new, old, adv, mask, 0.2, 0.2, agg="dr_grpo", max_len=4)  # Dr. GRPO: / (2 samples x 4)
    assert float(dr) == pytest.approx((-1.2 - 1.0 + 0.8) / 8)
    short = torch.tensor([[True, False], [True, False]])  # shorter answers: the denominator does not shrink
    assert float(grpo_loss(new, old, adv, short, 0.2, 0.2, agg="dr_grpo", max_len=4)[0]) == pytest.approx((-1.2 + 0.8) / 8)
    with pytest.raises(ValueError, match="max_len"):
        grpo_loss(new, old, adv, mask, 0.2, 0.2, agg="dr_grpo")
    ref = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    kl = kl_k3(new, ref)  # exp(d) - d - 1, d = ref - new
    d = math.log(0.5 / 0.75)
    assert float(kl[0, 0]) == pytest.approx(math.exp(d) - d - 1) and float(kl[0, 1]) == 0.0
    with_kl, st = grpo_loss(new, old, adv, mask, 0.2, 0.2, beta=0.5, ref_logp_NT=ref)
    assert float(with_kl) == pytest.approx(float(loss) + 0.5 * float((kl * mask).sum()) / 3)


# ---- rewards and the extractor -------------------------------------------------------------------------

@pytest.mark.parametrize("text, answer, fmt_ok, right", [
    ("<think>\n2+3=5\n</think>\nAnswer: 5", "5", True, True),
    ("<think>\n2+3=5\n</think>\n", "5", False, False),  # no answer line
    ("<think>\n2+3=5\n</think>\nAnswer: 5\nAnswer: 6", "5", False, False),  # two answer lines: no answer
    ("<think>\nx\n</think>\nAnswer: five", "5", True, False),  # non-numeric
    ("  <think>\n x \n</think>\n\n   Answer:    1,000.0  \n", "1000", True, True),  # extra whitespace, separators
    ("<think>\n2+3=5, Answer: 5\n</think>\nAnswer: 6", "5", True, False),  # right number only in the reasoning
    ("Answer: 5", "5", False, True),  # right but not in the format
])
def test_rewards_on_edge_cases(text, answer, fmt_ok, right):
    task = {"prompt": "q", "answer": answer}
    assert format_reward(text, task) == float(fmt_ok)
    assert correct_reward(text, task) == float(right)


def test_extractor_normalises_numbers_and_custom_rewards():
    assert [normalize_answer(x) for x in ("1,000", "1000.0", "+7", "$12", "3.50", "-0.0", "12.")] == \
        ["1000", "1000", "7", "12", "3.5", "0", "12"]
    assert extract_answer(DEFAULT_FORMAT.render("a\nb", "1,234")) == "1234"
    with pytest.raises(ConfigError, match="module:function"):
        Rewards(["nope"], [1.0])
    with pytest.raises(ConfigError, match="cannot load"):
        Rewards(["no_such_module_x:f"], [1.0])
    r = Rewards(["format", "correct", f"{__name__}:brevity"], [1.0, 2.0, 0.5])  # any module:function
    texts = ["<think>\nok\n</think>\nAnswer: 3", "Answer: 4"]  # 29 and 9 characters
    parts, total = r(texts, [{"answer": "3"}, {"answer": "3"}])
    assert parts == {"format": [1.0, 0.0], "correct": [1.0, 0.0], f"{__name__}:brevity": [-29 / 50, -9 / 50]}
    assert total == pytest.approx([1 + 2 - 0.5 * 29 / 50, -0.5 * 9 / 50])


def brevity(completion: str, task: dict) -> float:
    return -len(completion) / 50


# ---- the engine and the trainer ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    tasks = write_tasks(root / "tasks.jsonl", n=32)
    return root, tasks, tiny_model(root, tasks)


def _cfg(model: Path, tasks: Path, *extra: str) -> TrainConfig:
    return load_config(TrainConfig, ROOT / "configs/grpo.yaml", [
        f"model.init={model}", f"data.path={tasks}", "train.max_steps=3", "train.lr=3e-3", "train.log_every=0",
        "grpo.prompts_per_step=2", "grpo.group_size=4", "grpo.max_tokens=12", "train.ckpt_every=1",
        "grpo.rewards=[format, correct, 'reasoning_fixtures:length_reward']", "grpo.reward_weights=[1, 1, 1]", *extra])


def test_engine_logprobs_equal_trainer_logprobs_and_follow_updates(setup):
    from lmforge.train.grpo.trainer import GRPOTrainer, _batch, _policy_logprobs

    root, tasks, model = setup
    tr = GRPOTrainer(_cfg(model, tasks, "grpo.epochs=2"), root / "lp", overwrite=True)
    rollouts = tr.engine.generate(["What is 12 + 34?", "What is 50 + 7?"], step=1)
    assert len(rollouts) == 8 and all(len(r.completion_ids) == len(r.logprobs) > 0 for r in rollouts)
    batch = _batch(rollouts, tr.pad_id, tr.device)
    with torch.no_grad():
        logp, _ = _policy_logprobs(tr.model, batch["input_ids"])
    gap = ((logp - batch["old_logp"]).abs() * batch["mask"]).max()
    assert float(gap) < 1e-4  # float32; paged attention vs one full forward: summation order only
    row = tr.step()  # two epochs: the second pass sees ratios != 1
    assert row["logprob_gap_max"] < 1e-4 and row["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    # after the update the engine samples from the new weights: its greedy tokens are the trainer model's own
    from lmforge.engine import SamplingParams
    from lmforge.train.grpo.rollout import chat_prompt_ids

    prompt = chat_prompt_ids(tr.engine.tokenizer, "What is 21 + 21?")
    out = tr.engine.llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                 use_tqdm=False)[0].outputs[0].token_ids
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(tr.model(torch.tensor([ids]))[0, -1].argmax()))
    assert out == ids[len(prompt):]
    from lmforge.model import Transformer

    initial = Transformer.from_pretrained(model, dtype="float32").state_dict()
    engine_now = tr.engine.llm.llm_engine.model.state_dict()
    assert any(not torch.equal(initial[k], engine_now[k]) for k in initial)  # it holds the updated weights


def test_config_refusals(setup):
    root, tasks, model = setup
    with pytest.raises(ConfigError, match="model.init"):
        load_config(TrainConfig, ROOT / "configs/grpo.yaml", [f"data.path={tasks}"]).validate()
    with pytest.raises(ConfigError, match="group_size"):
        _cfg(model, tasks, "grpo.group_size=1").validate()
    with pytest.raises(ConfigError, match="minibatches"):
        _cfg(model, tasks, "grpo.minibatches=3").validate()


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_resume_after_sigkill_is_exact(setup):
    """An uninterrupted run, and one killed by SIGKILL (from outside: no hook in the trainer) and resumed:
    the same rollouts (seeded) and bitwise-equal losses, CPU float32."""
    from lmforge.train.grpo.trainer import train_grpo

    root, tasks, model = setup
    extra = ("train.max_steps=4",)
    ref = train_grpo(_cfg(model, tasks, *extra), root / "ref", overwrite=True)
    assert ref["status"] == "finished" and (root / "ref" / "reward.png").is_file()
    killed = root / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent)}
    args = [sys.executable, "-m", "lmforge.train", str(ROOT / "configs/grpo.yaml"), f"model.init={model}",
            f"data.path={tasks}", "train.max_steps=1000", "train.lr=3e-3", "grpo.prompts_per_step=2",
            "grpo.group_size=4", "grpo.max_tokens=12", "train.ckpt_every=1",
            "grpo.rewards=[format, correct, 'reasoning_fixtures:length_reward']", "grpo.reward_weights=[1, 1, 1]",
            "--out", str(killed)]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if (killed / "metrics.jsonl").is_file() and len(_metrics(killed)) >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    res = train_grpo(_cfg(model, tasks, *extra), killed, resume=True)
    assert res["status"] == "finished"
    a, b = _metrics(root / "ref"), _metrics(killed)
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    for key in ("loss", "loss_first", "reward_mean", "response_len_mean", "rollout_tokens", "grad_norm"):
        assert [m[key] for m in a] == [m[key] for m in b], key
    assert any(m["loss"] != 0 for m in a)  # the test would prove nothing on a run that never learns
