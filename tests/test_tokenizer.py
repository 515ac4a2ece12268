"""Tokenizer training, the HF layout it writes, the chat template, the readers and the CLI.

Training runs once per module on ~300 KB (the first python-docs documents plus a little
multilingual text), so the whole file takes a few seconds on a 2-core CPU.

    python -m pytest -q tests/test_tokenizer.py
"""

from __future__ import annotations

import gzip
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmforge.data.readers import ReaderError, iter_documents, iter_texts
from lmforge.data.sources import iter_python_docs
from lmforge.tokenizer import (CHAT_TEMPLATE, SPECIAL_TOKENS, load_tokenizer, render_chat,
                               tokenizer_hash, train_tokenizer)


def lmforge_cmd(*args: str) -> list[str]:
    """The CLI as users run it: the `lmforge` console script of this environment."""
    return [str(Path(sys.executable).with_name("lmforge")), "tokenizer", *args]


MULTILINGUAL = ("Grüße aus Köln! Ça va? Ñandú. 你好，世界。こんにちは。안녕하세요. Привет, мир. "
                "مرحبا بالعالم. שלום. 🙂🚀 emoji\r\n\ttabs and  double  spaces\u00a0nbsp\n")
ROUND_TRIP_CASES = ["", " ", "  leading", "trailing  ", "\n\n\r\n\t", "\x00\x01\x7f", "🙂🏳️‍🌈",
                    "a\u0301 (combining)", "x" * 500, "<|im_start|>user\nhi<|im_end|>\n", MULTILINGUAL,
                    "def f(x):\n    return x ** 2  # 12345678\n"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    docs = list(itertools.islice(iter_python_docs(), 120))
    with open(root / "docs.jsonl", "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    (root / "nested" / "deeper").mkdir(parents=True)
    (root / "nested" / "deeper" / "notes.md").write_text(MULTILINGUAL * 20, encoding="utf-8")
    (root / "nested" / "ignored.bin").write_bytes(b"\xff\xfe not text")
    return root


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("tok") / "tok"
    record = train_tokenizer([str(corpus)], out, vocab_size=1000, show_progress=False)
    return record, out


@pytest.fixture(scope="module")
def hf_tok(trained):
    return load_tokenizer(trained[1])


@pytest.fixture(scope="module")
def raw_tok(trained):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(trained[1] / "tokenizer.json"))


# --- training and layout -------------------------------------------------------------------

def test_writes_hf_layout_and_record(trained):
    record, out = trained
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "config.yaml", "record.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "record.json").read_text()) == json.loads(json.dumps(record, default=str))
    assert record["tokenizer_hash"] == tokenizer_hash(out)
    assert record["docs"] == 121 and record["bytes"] > 100_000
    assert record["bytes_per_token"] > 1.5  # merges were learned, not just bytes
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["chat_template"] == CHAT_TEMPLATE


def test_vocab_rounded_to_multiple_of_64_and_exact(trained, hf_tok, raw_tok):
    record, _ = trained
    assert record["requested_vocab_size"] == 1000 and record["vocab_size"] == 1024
    assert any("rounded up to 1024" in n for n in record["notes"])
    assert len(hf_tok) == 1024 == raw_tok.get_vocab_size(with_added_tokens=True)
    assert len(hf_tok) % 64 == 0


def test_small_corpus_filled_with_reserved_tokens_exactly(tmp_path):
    (tmp_path / "a.txt").write_text("tiny corpus " * 10)
    record = train_tokenizer([str(tmp_path / "a.txt")], tmp_path / "tok", vocab_size=300,
                             show_progress=False, pad_to_multiple_of=1)
    assert record["vocab_size"] == 300 and record["reserved_tokens"] > 0
    tok = load_tokenizer(tmp_path / "tok")
    assert len(tok) == 300
    assert tok.convert_tokens_to_ids(f"<|reserved_{record['reserved_tokens'] - 1}|>") == 299


def test_special_tokens(hf_tok, raw_tok):
    assert [hf_tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert (hf_tok.bos_token, hf_tok.eos_token, hf_tok.pad_token) == (
        "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")
    assert hf_tok.model_max_length == 2048
    # A marker in text is one token, never split into bytes.
    assert raw_tok.encode("<|im_end|>").ids == [4]
    assert hf_tok.encode("hello", add_special_tokens=True) == raw_tok.encode("hello").ids  # no auto BOS


def test_refuses_to_overwrite_finished_dir(trained, tmp_path):
    with pytest.raises(FileExistsError, match="overwrite"):
        train_tokenizer(["python-docs"], trained[1], show_progress=False)
    (tmp_path / "a.txt").write_text("some text " * 20)
    train_tokenizer([str(tmp_path / "a.txt")], tmp_path / "tok", vocab_size=320, show_progress=False)
    train_tokenizer([str(tmp_path / "a.txt")], tmp_path / "tok", vocab_size=384, show_progress=False,
                    overwrite=True)
    assert len(load_tokenizer(tmp_path / "tok")) == 384


def test_rejects_vocab_below_bytes_plus_specials(tmp_path):
    with pytest.raises(ValueError, match="too small"):
        train_tokenizer(["python-docs"], tmp_path / "tok", vocab_size=100, pad_to_multiple_of=1)


# --- round trips ---------------------------------------------------------------------------

@pytest.mark.parametrize("text", ROUND_TRIP_CASES)
def test_round_trip_cases(raw_tok, hf_tok, text):
    assert raw_tok.decode(raw_tok.encode(text).ids, skip_special_tokens=False) == text
    assert hf_tok.decode(hf_tok.encode(text), skip_special_tokens=False) == text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text())
def test_round_trip_any_unicode_tokenizers(raw_tok, text):
    assert raw_tok.decode(raw_tok.encode(text).ids, skip_special_tokens=False) == text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text())
def test_round_trip_any_unicode_transformers(hf_tok, text):
    ids = hf_tok.encode(text, add_special_tokens=False)
    assert hf_tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == text


# --- chat template -------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


def test_chat_template_renders_two_turns(hf_tok):
    text = hf_tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert text == ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n4<|im_end|>\n"
                    "<|im_start|>user\nAnd 3+3?<|im_end|>\n")
    assert text == render_chat(CONVERSATION)


def test_chat_template_generation_prompt(hf_tok):
    text = hf_tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert text == render_chat(CONVERSATION, add_generation_prompt=True)
    ids = hf_tok.apply_chat_template(CONVERSATION, tokenize=True, add_generation_prompt=True,
                                     return_dict=True)["input_ids"]
    assert ids.count(hf_tok.convert_tokens_to_ids("<|im_start|>")) == 5
    assert ids.count(hf_tok.convert_tokens_to_ids("<|im_end|>")) == 4


# --- readers -------------------------------------------------------------------------------

def test_missing_input_named_before_any_work(tmp_path):
    missing = tmp_path / "no-such-file.jsonl"
    started = time.perf_counter()
    with pytest.raises(FileNotFoundError, match="no-such-file.jsonl"):
        iter_texts(["python-docs", str(missing)])  # python-docs is not read first
    assert time.perf_counter() - started < 1.0
    with pytest.raises(FileNotFoundError, match="no-such-file.jsonl"):
        train_tokenizer(["python-docs", str(missing)], tmp_path / "tok", show_progress=False)
    assert not (tmp_path / "tok").exists()


def test_malformed_jsonl_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n{"text": oops}\n')
    docs = iter_documents([str(bad)])
    assert next(docs)["text"] == "fine"
    with pytest.raises(ReaderError, match=r"bad\.jsonl:3"):
        next(docs)
    other = tmp_path / "other.jsonl"
    other.write_text('{"body": "no text field"}\n')
    with pytest.raises(ReaderError, match=r"other\.jsonl:1.*'text'"):
        list(iter_texts([str(other)]))
    assert list(iter_texts([str(other)], text_field="body")) == ["no text field"]


def test_reads_dirs_globs_gzip_in_sorted_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("z whole file\nline two")
    (tmp_path / "a.md").write_text("a")
    (tmp_path / "skip.csv").write_text("not read")
    with gzip.open(tmp_path / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"id": "c1", "text": "gz one", "meta": {"k": 1}}) + "\n")
    docs = list(iter_documents([str(tmp_path)]))
    assert [d["text"] for d in docs] == ["a", "gz one", "z whole file\nline two"]
    assert docs[1]["id"] == "c1" and docs[1]["meta"]["k"] == 1
    assert list(iter_texts([str(tmp_path / "**" / "*.txt")])) == ["z whole file\nline two"]
    with pytest.raises(FileNotFoundError, match=r"\*\.parquet"):
        iter_texts([str(tmp_path / "*.parquet")])


# --- CLI -----------------------------------------------------------------------------------

def test_cli_train_writes_tokenizer(tmp_path):
    (tmp_path / "corpus.txt").write_text(MULTILINGUAL * 50, encoding="utf-8")
    out = tmp_path / "tok"
    proc = subprocess.run(lmforge_cmd("train", str(tmp_path / "corpus.txt"), "--vocab-size", "320",
                                      "--out", str(out), "--no-progress"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "bytes per token" in proc.stdout
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "config.yaml", "record.json"):
        assert (out / name).is_file(), name
    again = subprocess.run(lmforge_cmd("train", str(tmp_path / "corpus.txt"), "--out", str(out)),
                           capture_output=True, text=True, timeout=120)
    assert again.returncode != 0 and "--overwrite" in again.stderr


def test_cli_missing_input_is_named(tmp_path):
    proc = subprocess.run(lmforge_cmd("train", str(tmp_path / "absent.txt"), "--out", str(tmp_path / "o")),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "absent.txt" in proc.stderr


def _folder_with(trained_dir: Path, dest: Path, config: dict | None, **tok_config) -> Path:
    """A copy of the trained tokenizer folder with its tokenizer_config.json edited and a config.json."""
    import shutil

    shutil.copytree(trained_dir, dest)
    tc = json.loads((dest / "tokenizer_config.json").read_text()) | tok_config
    (dest / "tokenizer_config.json").write_text(json.dumps(tc))
    if config is not None:
        (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.mark.parametrize("model_type", [None, "llama", "mistral", "qwen3"])
def test_generic_folders_open_as_autotokenizer_would(trained, tmp_path, model_type):
    """The direct open of a generic `tokenizer_class` (no AutoTokenizer import) gives AutoTokenizer's class,
    token ids, decoded text, special tokens and chat template: a transformers upgrade that changed
    AutoTokenizer's choice for these model types fails here."""
    from transformers import AutoTokenizer

    from lmforge.tokenizer.load import generic_backend

    _, out = trained
    d = _folder_with(out, tmp_path / "m", None if model_type is None else {"model_type": model_type})
    assert generic_backend(d)
    ours, theirs = load_tokenizer(d), AutoTokenizer.from_pretrained(str(d))
    assert type(ours) is type(theirs)
    for text in ROUND_TRIP_CASES:
        ids = ours.encode(text)
        assert ids == theirs.encode(text)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.all_special_ids) == \
        (theirs.bos_token, theirs.eos_token, theirs.pad_token, theirs.all_special_ids)
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("config,tok_config", [
    ({"model_type": "qwen2"}, {}),  # AutoTokenizer swaps in Qwen2Tokenizer for this model type
    ({"model_type": "llama", "_name_or_path": "deepseek-ai/deepseek-coder-1b"}, {}),
    ({"model_type": "llama"}, {"auto_map": {"AutoTokenizer": ["x.Tok", None]}}),
    ({"model_type": "llama"}, {"tokenizer_class": "GPT2Tokenizer"}),
])
def test_other_folders_keep_autotokenizer(trained, tmp_path, config, tok_config):
    from lmforge.tokenizer.load import generic_backend

    _, out = trained
    assert not generic_backend(_folder_with(out, tmp_path / "m", config, **tok_config))


def test_generic_open_imports_no_autotokenizer(trained):
    """What the direct open is for: the model-config import chain (torch.distributed.tensor) stays out."""
    _, out = trained
    code = ("import sys; from lmforge.tokenizer.load import load_tokenizer; load_tokenizer(sys.argv[1]); "
            "bad = [m for m in ('transformers.models.auto.tokenization_auto', 'torch.distributed.tensor') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code, str(out)], check=True, timeout=120)
