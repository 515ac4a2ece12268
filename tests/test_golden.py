"""Golden values that a behaviour-preserving change must keep to the bit (torchtitan's rule for
refactors: a fixed seed's loss curve stays identical).

Pinned before the architecture redesign (issue 23): the tiny config's training loss at steps 1/10/50
and its validation loss, the loss of a run resumed from its step-25 checkpoint, a float64 model's greedy
tokens through the engine, the engine's token counts on the benchmark's own request generator, and two
GRPO steps' losses. Regenerate (only when a change *means* to move numbers, and say so in the commit):

    .venv/bin/python tests/test_golden.py --write

Floating-point sums depend on the CPU's vector width, so the values carry the kernel path that made them
(`torch.backends.cpu.get_cpu_capability()`): on that path they must match exactly; on another, losses
must agree to 1e-4 relative (1e-6 absolute near zero) and integer outputs (tokens, counts) exactly.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GOLDEN = HERE / "golden.json"
sys.path.insert(0, str(HERE))

from reasoning_fixtures import tiny_model, write_tasks  # noqa: E402
from test_train_loop import make_packed  # noqa: E402

from lmforge.config import load_config  # noqa: E402
from lmforge.engine import LLM, SamplingParams  # noqa: E402
from lmforge.train.config import TrainConfig  # noqa: E402


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def pretrain_values(root: Path) -> dict:
    from lmforge.train.loop import train

    packed = make_packed(root / "data")
    args = [f"data.path={packed}", "train.max_steps=50", "train.ckpt_every=25", "train.eval_every=25",
            "train.log_every=0", "train.target_val_loss=100", "train.preflight=false"]
    cfg = load_config(TrainConfig, ROOT / "configs/tiny.yaml", args)
    train(cfg, root / "a")
    full = _metrics(root / "a")
    loss = {m["step"]: m["loss"] for m in full if "loss" in m}
    val = [m["val_loss"] for m in full if m.get("val_loss") is not None]
    # The same run stopped at step 25 (its checkpoint), then resumed to 50 under the step-50 config.
    short = load_config(TrainConfig, ROOT / "configs/tiny.yaml", [*args[:1], "train.max_steps=25", *args[2:]])
    train(short, root / "b")
    train(cfg, root / "b", resume=True)
    resumed = {m["step"]: m["loss"] for m in _metrics(root / "b") if "loss" in m}
    return {"loss_step_1": loss[1], "loss_step_10": loss[10], "loss_step_50": loss[50], "val_losses": val,
            "resumed_loss_step_26": resumed[26], "resumed_loss_step_50": resumed[50]}


def engine_values(root: Path) -> dict:
    from lmforge.model.reference import save_hf_model
    from lmforge.bench.engine import make_requests

    model = root / "llama-tiny"
    save_hf_model("llama", model, vocab_size=512, hidden_size=64, layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
    llm = LLM(str(model), dtype="float64", device="cpu", max_num_seqs=8, max_num_batched_tokens=128,
              max_model_len=512, enable_prefix_caching=True)
    reqs = make_requests("high-variance", 12, 0, 512, max_len=512)
    params = [SamplingParams(temperature=0.0, max_tokens=min(r.output_len, 24), ignore_eos=True) for r in reqs]
    outs = llm.generate([r.prompt for r in reqs], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    shared = make_requests("shared-prefix", 8, 1, 512, max_len=512)
    outs = llm.generate([r.prompt for r in shared], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    stats = llm.stats()
    return {"greedy_tokens": tokens, "prompt_tokens": sum(len(r.prompt) for r in reqs + shared),
            "output_tokens": sum(len(t) for t in tokens) + sum(len(o.outputs[0].token_ids) for o in outs),
            "shared_prefix_first_tokens": [o.outputs[0].token_ids[0] for o in outs],
            "prefix_cache_hits": stats["prefix_cache_hits"]}


def grpo_values(root: Path) -> dict:
    from lmforge.train.grpo.trainer import train_grpo

    root.mkdir(parents=True)
    tasks = write_tasks(root / "tasks.jsonl", n=32)
    model = tiny_model(root, tasks)
    cfg = load_config(TrainConfig, ROOT / "configs/grpo.yaml", [
        f"model.init={model}", f"data.path={tasks}", "train.max_steps=2", "train.lr=3e-3", "train.log_every=0",
        "grpo.prompts_per_step=2", "grpo.group_size=4", "grpo.max_tokens=12", "train.ckpt_every=0",
        "grpo.rewards=[format, correct, 'reasoning_fixtures:length_reward']", "grpo.reward_weights=[1, 1, 1]"])
    train_grpo(cfg, root / "grpo")
    m = _metrics(root / "grpo")
    return {"grpo_loss": [x["loss"] for x in m], "grpo_reward_mean": [x["reward_mean"] for x in m],
            "grpo_rollout_tokens": [x["rollout_tokens"] for x in m]}


def compute(root: Path) -> dict:
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference was taken on one thread: reductions split the same way
    try:
        return {**pretrain_values(root / "pretrain"), **engine_values(root / "engine"),
                **grpo_values(root / "grpo")}
    finally:
        torch.set_num_threads(n)


def _close(a, b, exact: bool) -> bool:
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_close(x, y, exact) for x, y in zip(a, b))
    if isinstance(a, float) and not exact:
        # abs 1e-6: a GRPO loss on its first pass (ratio 1) is the mean of zero-mean advantages, ~1e-7 of
        # rounding whose digits move with the vector width (Zen 4's golden against an AVX2 EPYC: 2.6e-7 vs 2.8e-7)
        return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)
    return a == b


@pytest.fixture(scope="module")
def values(tmp_path_factory) -> dict:
    return compute(tmp_path_factory.mktemp("golden"))


def test_golden_values_unchanged(values):
    golden = json.loads(GOLDEN.read_text())
    exact = golden["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert values.keys() == golden["values"].keys()
    changed = {k: (golden["values"][k], v) for k, v in values.items() if not _close(golden["values"][k], v, exact)}
    assert not changed, f"golden values moved ({'exact' if exact else 'rel 1e-4'} check): {changed}"


if __name__ == "__main__" and "--write" in sys.argv:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        vals = compute(Path(d))
    GOLDEN.write_text(json.dumps({"cpu_capability": torch.backends.cpu.get_cpu_capability(),
                                  "torch": torch.__version__, "values": vals}, indent=1) + "\n")
    print(f"wrote {GOLDEN}")
