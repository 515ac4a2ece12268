"""`lmforge generate` (lmforge.engine.batch): OpenAI records in input order, per-line sampling
fields, resume after a kill, and `--executor ray --replicas 2` giving the single-process bytes
(greedy). A tiny random llama with a 320-token BPE tokenizer; one local 2-CPU Ray cluster.

    python -m pytest -q tests/test_engine_batch.py
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import ray
import typer
from typer.testing import CliRunner

from lmforge.engine.batch import generate_file, read_requests
from lmforge.engine.commands import generate
from lmforge.model.reference import save_hf_model
from test_data_pack import tok_dir  # noqa: F401  (a fixture: a 320-token tokenizer)

ENGINE = {"device": "cpu", "block_size": 4}
LINES = [{"custom_id": "a", "prompt": "alpha beta gamma"},
         {"prompt": "tensor matrix", "max_tokens": 3},
         {"custom_id": "chat", "messages": [{"role": "user", "content": "python module function"}]},
         {"custom_id": "ids", "prompt": [5, 6, 7, 8]},
         {"custom_id": "e", "prompt": "error packet", "stop": ["zz"], "meta": {"source": "test"}},
         {"custom_id": "f", "prompt": "engine token value", "max_tokens": 5},
         {"custom_id": "g", "prompt": "return value"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory, tok_dir) -> Path:  # noqa: F811
    path = save_hf_model("llama", tmp_path_factory.mktemp("gen") / "model", vocab_size=320)
    for f in tok_dir.iterdir():
        if f.is_file():
            shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in LINES) + "\n")
    return path


@pytest.fixture(scope="module")
def local_out(model, prompts, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("local") / "out.jsonl"
    generate_file(model, prompts, out, defaults={"temperature": 0.0, "max_tokens": 6}, batch_size=3,
                  engine_kwargs=ENGINE)
    return out


def test_records_in_input_order_with_per_line_params(local_out):
    recs = [json.loads(line) for line in local_out.read_text().splitlines()]
    assert [r["custom_id"] for r in recs] == ["a", "2", "chat", "ids", "e", "f", "g"]
    assert [r["object"] for r in recs][2:4] == ["chat.completion", "text_completion"]
    assert recs[2]["choices"][0]["message"]["role"] == "assistant" and recs[2]["id"] == "chatcmpl-chat"
    lengths = [len(r["choices"][0]["token_ids"]) for r in recs]
    assert lengths[1] <= 3 and lengths[5] <= 5 and max(lengths) <= 6  # per-line max_tokens over the default
    assert all(r["usage"]["total_tokens"] == r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"]
               for r in recs)
    assert recs[3]["usage"]["prompt_tokens"] == 4
    assert sum(bool(r["choices"][0].get("text")) for r in recs) >= 4  # decoded: the comparisons see text


def test_resume_keeps_written_records_and_cuts_a_torn_line(model, prompts, local_out, tmp_path):
    out = tmp_path / "out.jsonl"
    lines = local_out.read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(lines[:2]) + lines[2][:15])  # killed while writing the third record
    summary = generate_file(model, prompts, out, defaults={"temperature": 0.0, "max_tokens": 6},
                            engine_kwargs=ENGINE)
    assert summary["resumed"] == 2 and summary["generated"] == 5
    assert out.read_bytes() == local_out.read_bytes()
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"custom_id": "zzz"}) + "\n")
    with pytest.raises(ValueError, match="custom_id 'zzz'.*overwrite"):
        generate_file(model, prompts, other, engine_kwargs=ENGINE)


def test_bad_lines_named_before_any_work(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n{"prompt": "y", "temprature": 0}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: unknown field\(s\) temprature"):
        read_requests(bad)
    bad.write_text('{"prompt": "x", "top_p": 0}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: SamplingParams.top_p"):
        read_requests(bad)
    app = typer.Typer()
    app.command()(generate)
    res = CliRunner().invoke(app, [str(tmp_path), "--input", str(bad), "--out", str(tmp_path / "o.jsonl"),
                                   "--replicas", "2"])
    assert res.exit_code == 2 and "--executor ray" in res.output


def test_duplicate_ids_and_every_bad_line_are_named_before_any_work(model, tmp_path):
    """Issue 43: a duplicate custom_id gave two records with it; an empty prompt, a token id past the
    vocabulary or a prompt longer than the context stopped the run without a line number."""
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"custom_id": "a", "prompt": "x"}\n{"prompt": "y"}\n{"custom_id": "a", "prompt": "z"}\n'
                   '{"id": 2, "prompt": "w"}\n')
    with pytest.raises(ValueError) as e:
        read_requests(dup)
    assert "dup.jsonl:3: custom_id 'a' is also line 1's" in str(e.value)
    assert "dup.jsonl:4: custom_id '2' is also line 2's" in str(e.value)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": "fine"}, {"prompt": ""}, {"prompt": [5, 999999]}, {"prompt": "word " * 3000},
        {"prompt": []}, {"prompt": "also fine"}]) + "\n")
    out = tmp_path / "out.jsonl"
    with pytest.raises(ValueError) as e:
        generate_file(model, bad, out, defaults={"max_tokens": 4}, engine_kwargs={**ENGINE, "max_model_len": 256})
    lines = str(e.value).splitlines()
    assert [line.split(": ", 1)[0].rsplit(":", 1)[1] for line in lines[1:]] == ["2", "3", "4", "5"], str(e.value)
    assert "empty" in lines[1] and "999999" in lines[2] and "max_model_len" in lines[3]
    assert not out.exists()  # nothing generated, --out untouched


def test_unseeded_sampling_resumes_to_the_uninterrupted_run(model, prompts, tmp_path):
    """Without a seed each record draws from a seed derived from its custom_id, so a run cut after two
    records and resumed writes what one run writes (it used to draw from the engine's one generator)."""
    kw = dict(defaults={"temperature": 1.0, "max_tokens": 6}, batch_size=2, engine_kwargs=ENGINE)
    whole, part = tmp_path / "whole.jsonl", tmp_path / "part.jsonl"
    generate_file(model, prompts, whole, **kw)
    part.write_bytes(b"".join(whole.read_bytes().splitlines(keepends=True)[:3]))
    generate_file(model, prompts, part, **{**kw, "batch_size": 3})
    assert part.read_bytes() == whole.read_bytes()
    again = tmp_path / "again.jsonl"
    generate_file(model, prompts, again, **kw)
    assert again.read_bytes() == whole.read_bytes()


def test_without_ray_generate_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(ImportError, match=r"pip install 'lmforge\[ray\]'"):
        generate_file(tmp_path, tmp_path / "p.jsonl", tmp_path / "o.jsonl", executor="ray", replicas=2)


def test_ray_replicas_give_the_single_process_bytes(model, prompts, local_out, tmp_path):
    if ray.is_initialized():  # another module's cluster: this test wants exactly 2 CPUs
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        out = tmp_path / "ray.jsonl"
        summary = generate_file(model, prompts, out, defaults={"temperature": 0.0, "max_tokens": 6},
                                executor="ray", replicas=2, batch_size=2, engine_kwargs=ENGINE)
    finally:
        ray.shutdown()
    assert summary["generated"] == len(LINES) and summary["replicas"] == 2
    assert out.read_bytes() == local_out.read_bytes()
