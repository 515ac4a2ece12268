"""The data flywheel's whole loop with DPO, through the CLI verbs a user types (docs/operations.md):

    lmforge serve --registry R --model tiny --log-requests     (the champion, v1: a real server process)
      -> POST /v1/feedback with corrections                     (the users)
    lmforge flywheel build                                     -> preferences.jsonl + dpo-lora.yaml
    lmforge train FW/dpo-lora.yaml                             (DPO, LoRA on the champion)
    lmforge export; lmforge registry add                       (v2)
    lmforge eval run; lmforge registry attach-eval             (both versions, the same frozen suite)
    lmforge registry alias tiny challenger 2; lmforge serve --canary 50   (both versions take traffic)
    lmforge registry promote tiny 2                            (the eval gate) -> champion v2

The servers are subprocesses; the other verbs run in-process through the same Typer app (a fresh
`lmforge` process costs seconds of imports on a loaded 2-core box).

    python -m pytest -q tests/test_flywheel_loop.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml
from typer.testing import CliRunner

from lmforge.cli import app
from lmforge.registry import Registry
from lmforge.serve.app import VERSION_HEADER
from lmforge.serve.testing import free_port

LMFORGE = str(Path(sys.executable).with_name("lmforge"))
QUESTIONS = ["How do I reverse a list?", "What does a dict map?", "Name a sorting algorithm.",
             "What is a tuple?", "How do I open a file?", "What is a set for?"]


def lmforge(*args: str) -> str:
    r = CliRunner().invoke(app, list(args))
    assert r.exit_code == 0, f"lmforge {' '.join(args)} exited {r.exit_code}:\n{r.output}\n{r.exception!r}"
    return r.output


class Server:
    """`lmforge serve ...` on a free loopback port, stopped with SIGTERM on exit."""

    def __init__(self, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([LMFORGE, "serve", *args, "--port", str(self.port), "--dtype", "float32",
                                      "--max-model-len", "256", "--no-engine-process"], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env)

    def __enter__(self) -> Server:
        t0 = time.monotonic()
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() - t0 > 240:
                self.proc.kill()
                raise AssertionError(f"lmforge serve did not become healthy:\n{self.proc.stdout.read()}")
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            assert self.proc.wait(timeout=60) == 0
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def test_serve_feedback_flywheel_dpo_export_registry_gate_canary_promote(chat_model_dir, tmp_path):
    db, fb = str(tmp_path / "registry.db"), str(tmp_path / "feedback.db")
    v1 = Path(shutil.copytree(chat_model_dir, tmp_path / "v1"))
    lmforge("registry", "add", "tiny", str(v1), "--registry", db)

    # the champion serves; users correct 5 of 6 answers (the sixth gets a thumbs down and no correction)
    with Server("--registry", db, "--model", "tiny", "--log-requests", "--feedback-db", fb) as srv:
        for i, q in enumerate(QUESTIONS):
            r = httpx.post(srv.url + "/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": q}], "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200 and r.headers[VERSION_HEADER] == "1"
            fix = {"correction": f"Answer {i}: see the Python tutorial, section {i + 1}."} if i < 5 else {}
            assert httpx.post(srv.url + "/v1/feedback", json={"id": r.json()["id"], "score": -1, **fix}
                              ).status_code == 200

    lmforge("flywheel", "build", "--feedback", fb, "--registry", db, "--model", "tiny", "--out",
            str(tmp_path / "fw"), "--min-count", "1")
    stats = json.loads((tmp_path / "fw" / "stats.json").read_text())
    assert stats["in"] == 6 and stats["preferences"] == 5 and stats["dropped"]["low_score_unpaired"] == 1
    cfg = yaml.safe_load((tmp_path / "fw" / "dpo-lora.yaml").read_text())
    assert cfg["train"]["stage"] == "dpo" and cfg["train"]["method"] == "lora"
    assert cfg["model"]["init"] == str(Registry(db).get("tiny", "champion").path)  # the champion is the reference

    # DPO on the pairs: the ready config as written, shortened for the test
    run = tmp_path / "dpo-run"
    lmforge("train", str(tmp_path / "fw" / "dpo-lora.yaml"), "train.max_steps=6", "train.lr=5e-3",
            "train.warmup_steps=0", "--out", str(run))
    rec = json.loads((run / "record.json").read_text())
    assert rec["status"] == "finished" and rec["config"]["train"]["stage"] == "dpo"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    margins = [m["rewards/margins"] for m in metrics if "rewards/margins" in m]
    assert margins and margins[-1] > margins[0]  # the policy moved toward the corrections, away from the served text

    lmforge("export", str(run), "--out", str(tmp_path / "v2"))
    lmforge("registry", "add", "tiny", str(tmp_path / "v2"), "--registry", db)
    v2 = Registry(db).get("tiny", 2)
    assert v2.sha256 != Registry(db).get("tiny", 1).sha256  # the adapter was merged into new weights

    for version, folder in ((1, v1), (2, tmp_path / "v2")):
        lmforge("eval", "run", str(folder), "--suite", "tiny-text", "--limit", "8", "--dtype", "float32",
                "--device", "cpu", "--out", str(tmp_path / f"eval-{version}"))
        lmforge("registry", "attach-eval", "tiny", str(version), str(tmp_path / f"eval-{version}"), "--registry", db)

    lmforge("registry", "alias", "tiny", "challenger", "2", "--registry", db)
    with Server("--registry", db, "--model", "tiny", "--canary", "50") as srv:
        seen = {httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "The list", "max_tokens": 2,
                                                              "user": f"u{i}"}).headers[VERSION_HEADER]
                for i in range(24)}
    assert seen == {"1", "2"}  # both versions took traffic

    out = lmforge("registry", "promote", "tiny", "2", "--max-regression", "0.5", "--registry", db)
    assert "champion" in out
    reg = Registry(db)
    assert reg.get("tiny", "champion").version == 2 and reg.get("tiny", "previous").version == 1
    kinds = [e["kind"] for e in reg.events("tiny")]
    assert kinds.count("attach_eval") == 2 and kinds[-1] == "promote"

