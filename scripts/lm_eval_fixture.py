"""Run lm-evaluation-harness for real, `--model hf` and `--model local-completions` against `lmforge serve`,
on the deterministic tiny model of `tests/test_lm_eval_fixture.py`, compare their per-request
log-likelihoods, and record the fixture that test replays (the exact payloads lm-eval sent, the context
lengths it parses with, and `--model hf`'s answers).

lm-eval is not a dependency of lmforge: install it into a venv of its own, e.g.

    python3 -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install "lm-eval[api]==0.4.13"
    .venv/bin/python scripts/lm_eval_fixture.py --lm-eval-python /tmp/lmeval/bin/python --out runs/lm-eval-fixture \
        [--write tests/fixtures/lm_eval_local_completions.json]

The lm-eval interpreter must import torch and transformers (a venv of its own installs them, or sees this
checkout's venv through a .pth file). Tasks: a 4-question multiple-choice JSONL (loglikelihood) and a
2-document loglikelihood_rolling JSONL, both local (no hub access). Prints the largest difference.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from lm_eval_tasks import ROLLING, build_model, write_tasks  # noqa: E402 - tests/lm_eval_tasks.py

from lmforge.serve.testing import free_port, spawn_server, stop_server  # noqa: E402

# Run inside the lm-eval interpreter: wraps the two models' request paths to record, per request, the token
# ids, the payload sent, the context length parsed with and the answer; then simple_evaluate.
DRIVER = textwrap.dedent('''
    import json, sys
    import lm_eval, lm_eval.tasks
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    model, model_args, include, out = sys.argv[1:5]
    records, payloads = [], []
    hf_tokens = HFLM._loglikelihood_tokens
    def hf_record(self, requests, **kw):
        res = hf_tokens(self, requests, **kw)
        records.extend({"tokens": r[1] + r[2], "ctxlen": len(r[1]), "answer": list(a)} for r, a in zip(requests, res))
        return res
    HFLM._loglikelihood_tokens = hf_record
    create = LocalCompletionsAPI._create_payload
    def create_record(self, *a, **kw):
        payloads.append(create(self, *a, **kw))
        return payloads[-1]
    LocalCompletionsAPI._create_payload = create_record
    parse = LocalCompletionsAPI.parse_logprobs
    def parse_record(outputs, tokens=None, ctxlens=None, **kw):
        res = parse(outputs, tokens=tokens, ctxlens=ctxlens, **kw)
        for t, c, a in zip(tokens, ctxlens, res):
            records.append({"tokens": t, "ctxlen": c, "answer": list(a), "payload": payloads[-1]})
        return res
    LocalCompletionsAPI.parse_logprobs = staticmethod(parse_record)
    tm = lm_eval.tasks.TaskManager(include_path=include)
    r = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["lmforge_mc", "lmforge_rolling"],
                                task_manager=tm, batch_size=1, device="cpu", log_samples=True)
    json.dump({"records": records, "results": r["results"],
               "samples": {k: [s["resps"] for s in v] for k, v in r["samples"].items()}}, open(out, "w"))
''')


def run_lm_eval(python: str, model: str, model_args: str, include: Path, out: Path) -> dict:
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PATH": "/usr/bin:/bin"}
    subprocess.run([python, "-c", DRIVER, model, model_args, str(include), str(out)], check=True, env=env)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lm-eval-python", required=True, help="an interpreter with lm-eval 0.4.x installed")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--write", type=Path, help="write the fixture here (tests/fixtures/...)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = build_model(args.out)
    include = write_tasks(args.out / "tasks")
    hf = run_lm_eval(args.lm_eval_python, "hf", f"pretrained={model_dir},dtype=float32", include,
                     args.out / "hf.json")
    port = free_port()
    server = spawn_server([str(model_dir), "--served-model-name", "tiny", "--dtype", "float32"], port)
    try:
        api = run_lm_eval(args.lm_eval_python, "local-completions",
                          f"model=tiny,base_url=http://127.0.0.1:{port}/v1/completions,tokenizer_backend=huggingface,"
                          f"tokenizer={model_dir},max_length=512,num_concurrent=1,max_retries=1",
                          include, args.out / "local_completions.json")
    finally:
        stop_server(server)
    expected = {tuple(r["tokens"]): r["answer"] for r in hf["records"]}
    diffs = [abs(r["answer"][0] - expected[tuple(r["tokens"])][0]) for r in api["records"]]
    greedy = all(r["answer"][1] == expected[tuple(r["tokens"])][1] for r in api["records"])
    print(f"{len(diffs)} requests; max |loglikelihood(local-completions) - loglikelihood(hf)| = {max(diffs):.2e} "
          f"nats; is_greedy equal: {greedy}")
    for task in ("lmforge_mc", "lmforge_rolling"):
        print(task, "hf:", hf["samples"][task], "\n", " " * len(task), "local-completions:", api["samples"][task])
    if args.write:
        fixture = {"lm_eval": "0.4.13", "rolling_docs": ROLLING,
                   "requests": [{"payload": r["payload"], "ctxlen": r["ctxlen"],
                                 "expected": expected[tuple(r["tokens"])]} for r in api["records"]]}
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(json.dumps(fixture, indent=1) + "\n")
        print("wrote", args.write)


if __name__ == "__main__":
    main()
