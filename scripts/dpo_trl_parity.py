"""DPO parity with TRL 1.16: the same tiny model, reference, pairs and beta through TRL's `DPOTrainer` and
through lmforge's DPO (`lmforge.train.pref_data` + `lmforge.train.dpo`); compares the token ids and
completion masks, the loss, TRL's logged metrics and every parameter's gradient.

TRL is a benchmark baseline, not a dependency: its side runs in its own environment (`make trl-env` builds
`.venv-trl`) as `--system trl`, which prints one JSON object. Run from the repository root with lmforge's
interpreter; it builds the tiny setup (tests/dpo_fixtures.py, seeded), runs both sides, and writes the
fixture that tests/test_train_dpo.py recomputes lmforge's side against:

    .venv/bin/python scripts/dpo_trl_parity.py --trl-python .venv-trl/bin/python --out tests/dpo_trl_reference.json

Cases: conversational pairs with the sigmoid loss (beta 0.1) and standard pairs with IPO (beta 0.5), 4 pairs,
float32 on CPU, the policy and a differently seeded reference (so the loss is not log 2). Gradients are
summarised per parameter (L2 norm, sum, first 6 values) to keep the fixture small.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [{"name": "conversational-sigmoid", "data": "conversational", "loss_type": "sigmoid", "beta": 0.1},
         {"name": "standard-ipo", "data": "standard", "loss_type": "ipo", "beta": 0.5}]
PAIRS, MAX_LENGTH = 4, 512
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


def grad_summary(named_params) -> dict[str, dict]:
    out = {}
    for name, p in named_params:
        g = p.grad.detach().double().flatten()
        out[name] = {"norm": float(g.norm()), "sum": float(g.sum()), "head": [float(x) for x in g[:6]]}
    return out


def rows_of(path: Path) -> list[dict]:
    rows = [json.loads(x) for x in path.read_text().splitlines()][:PAIRS]
    return [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows]


def run_trl(model_dir: str, ref_dir: str, data: str, loss_type: str, beta: float) -> dict:
    import datasets  # deferred: only in the TRL environment
    import torch
    import transformers
    import trl

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        args = trl.DPOConfig(output_dir=tmp, per_device_train_batch_size=PAIRS, beta=beta, loss_type=[loss_type],
                             max_length=MAX_LENGTH, report_to=[], use_cpu=True, bf16=False, fp16=False,
                             dataset_num_proc=None)
        trainer = trl.DPOTrainer(model=model, ref_model=ref, args=args,
                                 train_dataset=datasets.Dataset.from_list(rows_of(Path(data))), processing_class=tok)
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(PAIRS)])
        trainer.model.train()
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k in METRICS}
    return {"trl": trl.__version__, "transformers": transformers.__version__, "loss": float(loss),
            "metrics": metrics, "input_ids": batch["input_ids"].tolist(),
            "completion_mask": batch["completion_mask"].tolist(),
            "grads": grad_summary(trainer.model.named_parameters())}


def run_lmforge(model_dir: str, ref_dir: str, data: str, loss_type: str, beta: float) -> dict:
    import torch

    from lmforge.quant import load_pretrained
    from lmforge.tokenizer.load import load_tokenizer
    from lmforge.train.dpo import METRICS as OURS, dpo_loss, sequence_logps
    from lmforge.train.pref_data import collate, read_pairs

    assert OURS == METRICS
    tok = load_tokenizer(model_dir)
    pairs, _ = read_pairs(data, tok, MAX_LENGTH)
    batch = collate(pairs[:PAIRS], tok.pad_token_id, MAX_LENGTH)
    model = load_pretrained(model_dir, dtype="float32", device="cpu").train()
    ref = load_pretrained(ref_dir, dtype="float32", device="cpu").eval()
    with torch.no_grad():
        ref_logps, _ = sequence_logps(ref, batch)
    logps, lengths = sequence_logps(model, batch)
    losses, stats = dpo_loss(logps, ref_logps, lengths, beta, loss_type)
    loss = losses.mean()
    loss.backward()
    return {"loss": float(loss.detach()), "metrics": {k: float(stats[k].mean()) for k in METRICS},
            "input_ids": batch["input_ids"].tolist(), "completion_mask": batch["completion_mask"].tolist(),
            "grads": grad_summary(model.named_parameters())}


def compare(a: dict, b: dict) -> dict:
    """Largest absolute differences between two sides (ids must match exactly)."""
    names = sorted(set(a["grads"]) & set(b["grads"]))
    diffs = [abs(x - y) for n in names for x, y in zip(a["grads"][n]["head"] + [a["grads"][n]["norm"]],
                                                         b["grads"][n]["head"] + [b["grads"][n]["norm"]])]
    return {"same_ids": a["input_ids"] == b["input_ids"] and a["completion_mask"] == b["completion_mask"],
            "same_parameters": set(a["grads"]) == set(b["grads"]),
            "loss_abs_diff": abs(a["loss"] - b["loss"]),
            "metrics_max_abs_diff": max(abs(a["metrics"][k] - b["metrics"][k]) for k in METRICS),
            "grad_max_abs_diff": max(diffs), "grad_max_norm": max(a["grads"][n]["norm"] for n in names)}


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", choices=["trl", "lmforge"], help="one side only (prints JSON); needs --model etc.")
    ap.add_argument("--model")
    ap.add_argument("--ref")
    ap.add_argument("--data")
    ap.add_argument("--loss-type", default="sigmoid")
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--trl-python", default=".venv-trl/bin/python")
    ap.add_argument("--out", default="tests/dpo_trl_reference.json")
    a = ap.parse_args()
    if a.system:
        fn = run_trl if a.system == "trl" else run_lmforge
        print(json.dumps(fn(a.model, a.ref, a.data, a.loss_type, a.beta)))
        return
    sys.path.insert(0, str(ROOT / "tests"))
    import dpo_fixtures  # deferred: the test fixtures live in tests/

    import torch
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="dpo-parity-"))
    files = dpo_fixtures.build(tmp)
    out = {"command": "python scripts/dpo_trl_parity.py --trl-python .venv-trl/bin/python "
                      "--out tests/dpo_trl_reference.json",
           "pairs": PAIRS, "max_length": MAX_LENGTH,
           "hashes": {"tokenizer.json": sha(files["model"] / "tokenizer.json"),
                      "model.safetensors": sha(files["model"] / "model.safetensors"),
                      "ref.safetensors": sha(files["ref"] / "model.safetensors"),
                      **{k: sha(files[k]) for k in ("conversational", "standard")}},
           "cases": []}
    for case in CASES:
        argv = ["--model", str(files["model"]), "--ref", str(files["ref"]), "--data", str(files[case["data"]]),
                "--loss-type", case["loss_type"], "--beta", str(case["beta"])]
        proc = subprocess.run([a.trl_python, __file__, "--system", "trl", *argv], capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"TRL side failed:\n{proc.stderr[-4000:]}")
        trl_side = json.loads(proc.stdout.strip().splitlines()[-1])
        ours = run_lmforge(str(files["model"]), str(files["ref"]), str(files[case["data"]]), case["loss_type"],
                           case["beta"])
        cmp = compare(trl_side, ours)
        print(f"{case['name']}: loss TRL {trl_side['loss']:.8f} lmforge {ours['loss']:.8f}; {cmp}")
        out["cases"].append({**case, "trl": trl_side, "lmforge_at_recording": {k: ours[k] for k in ("loss", "metrics")},
                             "comparison": cmp})
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"-> {a.out}")


if __name__ == "__main__":
    main()
