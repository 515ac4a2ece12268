"""The shared progress helper (`lmforge.track.progress`): lines off a terminal, a bar on one, an ETA.

    python -m pytest -q tests/test_progress.py
"""

from __future__ import annotations

import io
import json
import time

from lmforge.track.progress import Progress, eta_s, fmt_duration


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_it_prints_plain_lines_with_counts_rate_and_eta(monkeypatch):
    monkeypatch.delenv("LMFORGE_PROGRESS", raising=False)
    out = io.StringIO()
    with Progress("generate", total=10, unit="req", stream=out, every_s=0) as p:
        for _ in range(4):
            p.advance()
    lines = out.getvalue().splitlines()
    assert len(lines) == 5 and "\r" not in out.getvalue()  # one per update (every_s=0) + the final one
    assert lines[0].startswith("generate: 1/10 req (10%)") and "ETA" in lines[0]
    assert lines[-1].startswith("generate: 4/10 req (40%)") and "done in" in lines[-1]


def test_lines_are_spaced_by_every_s():
    out = io.StringIO()
    p = Progress("prepare", stream=out, every_s=3600)
    for _ in range(1000):
        p.advance()
    assert out.getvalue() == ""  # nothing due yet
    p.close()
    assert out.getvalue().startswith("prepare: 1,000 it,") and out.getvalue().count("\n") == 1


def test_on_a_terminal_it_redraws_one_bar_and_ends_the_line(monkeypatch):
    monkeypatch.delenv("LMFORGE_PROGRESS", raising=False)
    out = _Tty()
    with Progress("eval", total=4, stream=out, every_s=0) as p:
        p.advance(4)
    text = out.getvalue()
    assert text.startswith("\r[") and text.endswith("\n") and "4/4 it (100%)" in text


def test_off_switch_silences_it(monkeypatch):
    monkeypatch.setenv("LMFORGE_PROGRESS", "off")
    out = io.StringIO()
    with Progress("x", total=2, stream=out, every_s=0) as p:
        p.advance(2)
    assert out.getvalue() == ""


def test_eta_and_durations():
    assert eta_s(25, 100, 10.0) == 30.0
    assert eta_s(0, 100, 10.0) is None and eta_s(5, None, 1.0) is None
    assert [fmt_duration(s) for s in (4.4, 185, 3720)] == ["4s", "3m05s", "1h02m"]


def test_data_prepare_reports_each_pass(tmp_path, capsys, monkeypatch):
    from lmforge.data.prepare import prepare_dataset

    monkeypatch.setenv("LMFORGE_PROGRESS_S", "0")
    src = tmp_path / "docs.jsonl"
    words = [f"w{i}" for i in range(400)]
    src.write_text("".join(json.dumps({"id": str(i), "text": " ".join(words[(i * 7 + j) % 400] for j in range(120))})
                           + "\n" for i in range(30)))
    prepare_dataset([str(src)], tmp_path / "out", workers=1, show_progress=True)
    err = capsys.readouterr().err
    assert "prepare: read + normalize: 30 docs" in err
    assert "prepare: clean + dedup: 30/30 docs (100%)" in err and "done in" in err


def test_a_heartbeat_prints_while_the_count_stands_still():
    out = io.StringIO()
    with Progress("eval arith", total=8, stream=out, every_s=0.05, heartbeat=True) as p:
        p.advance(2)
        time.sleep(0.4)
    lines = out.getvalue().splitlines()
    assert len(lines) >= 4 and all(ln.startswith("eval arith: 2/8 it (25%)") for ln in lines)


def test_generate_reports_records_written_of_the_input(tmp_path, monkeypatch):
    """`lmforge generate` off a terminal: the final line counts the records in --out of the input's lines, and
    a resumed run counts the records it found as done (not in its rate)."""
    from typer.testing import CliRunner

    from hf_models import save_hf_model
    from lmforge.cli import app

    monkeypatch.setenv("LMFORGE_PROGRESS_S", "3600")
    model = save_hf_model("llama", tmp_path / "model", vocab_size=128)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt": [5, 6, 7 + i]}) + "\n" for i in range(3)))
    args = ["generate", str(model), "--input", str(src), "--out", str(out), "--max-tokens", "2", "--batch-size", "2",
            "--dtype", "float32", "--device", "cpu"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "generate: 3/3 records (100%)" in r.stderr and "done in" in r.stderr
    src.write_text(src.read_text() + "".join(json.dumps({"prompt": [9, 9 + i]}) + "\n" for i in range(2)))
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0 and "generate: 5/5 records (100%)" in r.stderr and "3 resumed" in r.output


def test_step_clock_counts_only_the_steps_this_run_made(monkeypatch):
    from lmforge.track import progress

    now = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    clock = progress.StepClock(step=40, max_steps=100)  # resumed at step 40
    now[0] += 30.0  # 10 steps in 30 s: 50 steps left, 3 s each
    assert clock.eta(50) == "ETA 2m30s"
    now[0] += 150.0
    assert clock.eta(100) == "done in 3m00s"
