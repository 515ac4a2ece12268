"""SFTLoader: assistant-only labels, packing without cross-talk, padding, resume, ranks, errors.

The reference for "which tokens carry loss" is computed independently of the loader: the
conversation is rendered to a string with `render_chat`, encoded whole with offsets, and a
token counts as the assistant's when its characters lie inside an assistant content +
`<|im_end|>` span. A tiny tokenizer is trained once per module (a few seconds on CPU).

    python -m pytest -q tests/test_train_sft.py
"""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lmforge.model import ModelConfig, Transformer
from lmforge.tokenizer import load_tokenizer, render_chat, train_tokenizer
from lmforge.track.io import sha256_file
from lmforge.train.sft_data import IGNORE_INDEX, SFTDataError, SFTLoader

WORDS = ("the a model learns to answer questions about python code and data with short clear "
         "replies list dict loop function returns value error file line yes no why how").split()


pytestmark = pytest.mark.usefixtures("one_thread")


def sentence(rng: random.Random, n: int) -> str:
    # never starts with whitespace: then whole-string and per-piece encodings agree (see module doc)
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + rng.choice([".", "?", "!\nok"])


def conversation(rng: random.Random) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": sentence(rng, 4)}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 3)):
        msgs.append({"role": "user", "content": sentence(rng, rng.randint(2, 8))})
        msgs.append({"role": "assistant", "content": sentence(rng, rng.randint(1, 10))})
    return msgs


def write_jsonl(path: Path, conversations: list[list[dict]]) -> Path:
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    rng = random.Random(0)
    (root / "corpus.txt").write_text("\n".join(sentence(rng, 30) for _ in range(400)), encoding="utf-8")
    train_tokenizer([str(root / "corpus.txt")], root / "tok", vocab_size=512, show_progress=False)
    return load_tokenizer(root / "tok")


@pytest.fixture(scope="module")
def convs() -> list[list[dict]]:
    rng = random.Random(1)
    return [conversation(rng) for _ in range(24)]


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory, convs) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("chat") / "chat.jsonl", convs)


@pytest.fixture(scope="module")
def model(tok) -> Transformer:
    cfg = ModelConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    return Transformer(cfg).init_weights(seed=0).eval()


def reference(tok, messages) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered chat and, per token, whether it is assistant content/<|im_end|>."""
    text = render_chat(messages)
    spans, pos = [], 0
    for m in messages:
        header = f"<|im_start|>{m['role']}\n"
        body = m["content"] + "<|im_end|>"
        if m["role"] == "assistant":
            spans.append((pos + len(header), pos + len(header) + len(body)))
        pos += len(header) + len(body) + 1
    assert pos == len(text)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(a <= s and e <= b for a, b in spans) for s, e in enc["offset_mapping"]]
    return enc["input_ids"], mask


def segments(batch: dict, b: int) -> list[tuple[int, int]]:
    """[start, end) of each document in row b, padding excluded (pad rows carry no labels)."""
    doc = batch["doc_ids"][b].tolist()
    bounds = [0] + [t for t in range(1, len(doc)) if doc[t] != doc[t - 1]] + [len(doc)]
    return [(s, e) for s, e in zip(bounds, bounds[1:]) if (batch["labels"][b, s:e] != IGNORE_INDEX).any()]


def match(tok, convs, input_ids: list[int]) -> list[dict]:
    """The conversation of the file whose rendered ids (minus the last, which is only a target)
    are this row segment."""
    key = (id(tok), id(convs))
    if key not in _BY_INPUTS:
        _BY_INPUTS[key] = {tuple(reference(tok, m)[0][:-1]): m for m in convs}
    hit = _BY_INPUTS[key].get(tuple(input_ids))
    assert hit is not None, "a row segment matches no conversation of the file"
    return hit


_BY_INPUTS: dict[tuple, dict] = {}


def check_batch_against_reference(tok, convs, model, batch) -> None:
    """Masking, loss and isolation of every document of a batch, against each conversation alone."""
    with torch.no_grad():
        logits = model(batch["input_ids"], position_ids=batch["position_ids"], doc_ids=batch["doc_ids"])
        V = logits.shape[-1]
        loss = F.cross_entropy(logits.view(-1, V), batch["labels"].view(-1), ignore_index=IGNORE_INDEX)
        total, count = 0.0, 0
        for b in range(batch["input_ids"].shape[0]):
            for s, e in segments(batch, b):
                ids, mask = reference(tok, match(tok, convs, batch["input_ids"][b, s:e].tolist()))
                want_labels = [i if m else IGNORE_INDEX for i, m in zip(ids[1:], mask[1:])]
                assert batch["labels"][b, s:e].tolist() == want_labels
                assert batch["position_ids"][b, s:e].tolist() == list(range(e - s))
                alone = model(torch.tensor([ids[:-1]]))[0]  # (n, V), no packing, no doc_ids
                torch.testing.assert_close(logits[b, s:e], alone, atol=1e-5, rtol=1e-5)
                logp = alone.double().log_softmax(-1)
                for t, m in enumerate(mask[1:]):
                    if m:
                        total -= logp[t, ids[t + 1]].item()
                        count += 1
    assert count == int((batch["labels"] != IGNORE_INDEX).sum())
    assert loss.item() == pytest.approx(total / count, abs=1e-5)


# --- masking and packing ---------------------------------------------------------------------

def test_reference_tokenization_matches_chat_template(tok, convs):
    for m in convs:
        ids, _ = reference(tok, m)
        assert tok.apply_chat_template(m, tokenize=True)["input_ids"] == ids


def test_packed_loss_is_assistant_only_and_documents_are_isolated(tok, convs, chat_file, model):
    loader = SFTLoader(chat_file, tok, seq_len=192, batch_size=8, seed=0)
    assert loader.stats.rows < loader.stats.conversations  # really packed several per row
    batch = next(loader)
    assert set(batch) == {"input_ids", "labels", "doc_ids", "position_ids"}
    for t in batch.values():
        assert t.dtype == torch.long and t.shape == (8, 192)
    assert max(len(segments(batch, b)) for b in range(8)) > 1
    check_batch_against_reference(tok, convs, model, batch)


def test_labels_spell_exactly_the_assistant_replies(tok, convs, chat_file):
    """Decoding the labelled targets of a document gives each assistant reply + <|im_end|>, and
    nothing of the system/user messages or the `<|im_start|>assistant\\n` header."""
    loader = SFTLoader(chat_file, tok, seq_len=160, batch_size=4)
    batch = next(loader)
    for b in range(4):
        for s, e in segments(batch, b):
            messages = match(tok, convs, batch["input_ids"][b, s:e].tolist())
            labels = batch["labels"][b, s:e]
            learned = tok.decode(labels[labels != IGNORE_INDEX].tolist(), skip_special_tokens=False)
            assert learned == "".join(m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant")


def test_padded_mode_one_conversation_per_row(tok, convs, chat_file, model):
    loader = SFTLoader(chat_file, tok, seq_len=160, batch_size=4, packed=False, seed=3)
    assert loader.stats.rows == loader.stats.conversations == len(convs)
    batch = next(loader)
    pad = tok.convert_tokens_to_ids("<|pad|>")
    for b in range(4):
        (s, e), = segments(batch, b)
        assert s == 0 and (batch["input_ids"][b, e:] == pad).all()
        assert (batch["labels"][b, e:] == IGNORE_INDEX).all()
    check_batch_against_reference(tok, convs, model, batch)
    assert loader.stats.padding_tokens == loader.stats.rows * 160 - loader.stats.tokens


def test_truncation_is_counted_and_warned(tok, tmp_path):
    rng = random.Random(5)
    long = [{"role": "user", "content": sentence(rng, 3)}, {"role": "assistant", "content": sentence(rng, 200)}]
    short = [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Yes."}]
    path = write_jsonl(tmp_path / "long.jsonl", [long, short])
    with pytest.warns(UserWarning, match="1 conversation"):
        loader = SFTLoader(path, tok, seq_len=64, batch_size=1)
    assert loader.stats.truncated == 1 and loader.stats.conversations == 2
    rows = [next(loader) for _ in range(loader.stats.rows)]
    assert any((r["doc_ids"] == 0).all() for r in rows)  # the cut one fills a whole row


def test_conversation_without_assistant_tokens_is_skipped_and_counted(tok, tmp_path):
    rng = random.Random(6)
    path = write_jsonl(tmp_path / "c.jsonl", [[{"role": "user", "content": "Hi."}], conversation(rng)])
    with pytest.warns(UserWarning, match="no assistant"):
        loader = SFTLoader(path, tok, seq_len=64, batch_size=1)
    assert (loader.stats.conversations, loader.stats.without_assistant) == (1, 1)


def test_stats_and_hash(tok, chat_file):
    loader = SFTLoader(chat_file, tok, seq_len=160, batch_size=2)
    assert loader.data_hash == sha256_file(chat_file)
    assert loader.tokens_per_batch == 2 * 160
    s = loader.stats
    assert s.conversations == 24 and s.truncated == 0
    # one batch holding every row of the epoch: its labels are exactly the assistant tokens
    epoch = next(SFTLoader(chat_file, tok, seq_len=160, batch_size=s.rows))
    assert int((epoch["labels"] != IGNORE_INDEX).sum()) == s.assistant_tokens
    assert int((epoch["doc_ids"] == 0).sum()) >= s.rows  # every row starts with a conversation


# --- order, ranks, resume --------------------------------------------------------------------

def row_keys(batch) -> list[tuple]:
    return [tuple(r) for r in batch["input_ids"].tolist()]


def test_epochs_reshuffle_deterministically(tok, chat_file):
    a = SFTLoader(chat_file, tok, seq_len=128, batch_size=1, seed=7)
    b = SFTLoader(chat_file, tok, seq_len=128, batch_size=1, seed=7)
    n = a.steps_per_epoch
    assert n == a.stats.rows
    seq_a = [k for _ in range(2 * n) for k in row_keys(next(a))]  # two epochs
    seq_b = [k for _ in range(2 * n) for k in row_keys(next(b))]
    assert seq_a == seq_b and a.epoch == 1
    assert sorted(seq_a[:n]) == sorted(seq_a[n:]) and seq_a[:n] != seq_a[n:]


def test_ranks_take_disjoint_rows_of_the_global_batch(tok, chat_file):
    """W ranks with batch B see what one process with batch W*B sees, rank r every W-th row."""
    one = SFTLoader(chat_file, tok, seq_len=128, batch_size=6, seed=1)
    ranks = [SFTLoader(chat_file, tok, seq_len=128, batch_size=2, seed=1, rank=r, world_size=3)
             for r in range(3)]
    assert ranks[0].steps_per_epoch == one.steps_per_epoch
    for _ in range(one.steps_per_epoch + 1):
        whole = row_keys(next(one))
        parts = [row_keys(next(ld)) for ld in ranks]
        for r in range(3):
            assert parts[r] == whole[r::3]


def test_resume_gives_identical_next_batch(tok, chat_file):
    a = SFTLoader(chat_file, tok, seq_len=128, batch_size=4, seed=2)
    for _ in range(a.steps_per_epoch + 1):  # past an epoch boundary
        next(a)
    state = json.loads(json.dumps(a.state_dict()))  # survives a JSON checkpoint
    b = SFTLoader(chat_file, tok, seq_len=128, batch_size=4, seed=2)
    b.load_state_dict(state)
    for _ in range(a.steps_per_epoch):
        x, y = next(a), next(b)
        for k in x:
            assert torch.equal(x[k], y[k]), k
    with pytest.raises(ValueError, match="seed"):
        SFTLoader(chat_file, tok, seq_len=128, batch_size=4, seed=9).load_state_dict(state)
    with pytest.raises(ValueError, match="global_batch"):
        SFTLoader(chat_file, tok, seq_len=128, batch_size=2, seed=2).load_state_dict(state)


def test_too_few_rows_for_a_global_batch_is_refused(tok, chat_file):
    with pytest.raises(ValueError, match="fewer than one global batch"):
        SFTLoader(chat_file, tok, seq_len=128, batch_size=20, world_size=2)


# --- errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("bad, field", [
    ("{not json", "invalid JSON"),
    ('{"msgs": []}', "'messages'"),
    ('{"messages": [{"role": "user"}]}', "'messages[0].content'"),
    ('{"messages": [{"role": "user", "content": "a"}, {"content": "b"}]}', "'messages[1].role'"),
    ('{"messages": [{"role": "user", "content": 3}]}', "must be a string"),
    ('{"messages": [{"role": "assistant", "content": "x<|im_end|>y"}]}', "control token"),
])
def test_malformed_line_names_file_line_and_field(tok, tmp_path, bad, field):
    good = json.dumps({"messages": conversation(random.Random(0))})
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{good}\n\n{bad}\n{good}\n", encoding="utf-8")
    with pytest.raises(SFTDataError) as err:
        SFTLoader(path, tok, seq_len=64, batch_size=1)
    assert f"{path}:3:" in str(err.value) and field in str(err.value)


def test_loader_raises_nothing_on_clean_file(tok, chat_file):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SFTLoader(chat_file, tok, seq_len=160, batch_size=1)
