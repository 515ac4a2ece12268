"""IncrementalDetokenizer: streamed deltas add up to `decode`, never split a character, never
leak a stop string. The tokenizer is a tiny byte-level BPE trained here, offline, in well
under a second, on generated English + CJK + emoji text (so CJK and emoji span tokens).

    python -m pytest -q tests/test_engine_detokenizer.py
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from lmforge.engine.detokenizer import IncrementalDetokenizer
from lmforge.engine.sampling_params import SamplingParams

SPECIALS = ["<|endoftext|>", "<|im_end|>"]


def corpus(lines: int = 400) -> list[str]:
    rng = random.Random(0)
    words = "the model reads a token and writes text one step at a time while the engine streams".split()
    cjk = "你好世界今天天气很好我们一起学习语言模型こんにちは안녕하세요"
    emoji = "🙂🚀🎉👍🏽🌍"
    return [" ".join(rng.choice(words) for _ in range(8)) + " " + "".join(rng.sample(cjk, 4))
            + rng.choice(emoji) + "\n" for _ in range(lines)]


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=SPECIALS, show_progress=False)
    backend.train_from_iterator(corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=SPECIALS[0])


def stream(tok, ids: list[int], params: SamplingParams, prompt: list[int] | None = None):
    """Feed ids one at a time as the engine does; return (deltas, stopped_at_step, detokenizer)."""
    detok = IncrementalDetokenizer(tok, params, prompt if prompt is not None else tok.encode("User: hi\n"))
    deltas: list[str] = []
    for step, token in enumerate(ids):
        delta, stopped = detok.step([token])
        deltas.append(delta)
        if stopped:
            return deltas, step, detok
    deltas.append(detok.flush())
    return deltas, None, detok


def decode(tok, ids: list[int], skip: bool = True) -> str:
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def test_cjk_and_emoji_span_several_tokens(tok):
    # Guards the premise of the next tests: some single characters need more than one token.
    ids = tok.encode("🙂🚀 語言")
    assert any("\ufffd" in decode(tok, [i]) for i in ids)


TEXT = st.text(alphabet=st.one_of(st.characters(codec="utf-8", exclude_categories=["Cs"]),
                                  st.sampled_from(list("你好世界🙂🚀🎉👍🏽 \n"))), max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT)
def test_deltas_add_up_to_decode_and_never_split_a_character(tok, text):
    ids = tok.encode(text)
    deltas, stopped, detok = stream(tok, ids, SamplingParams())
    assert stopped is None
    assert "".join(deltas) == decode(tok, ids) == detok.text
    if "\ufffd" not in detok.text:
        assert not any("\ufffd" in d for d in deltas)
        assert deltas[-1] == ""  # nothing was held back longer than needed: flush has nothing left


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT, cut=st.integers(0, 40))
def test_final_only_without_stops_decodes_once_at_the_end_to_the_same_text(tok, text, cut):
    """LLM.generate's requests (final_only, no stop strings) skip the per-token decode; the text at
    the end, and the text an abort releases part-way, are those of the incremental path."""
    ids = tok.encode(text)
    lazy_params, eager_params = SamplingParams(output_kind="final_only"), SamplingParams()
    deltas, _, eager = stream(tok, ids, eager_params)
    lazy_deltas, _, lazy = stream(tok, ids, lazy_params)
    assert lazy.lazy and not eager.lazy and not IncrementalDetokenizer(tok, SamplingParams(
        output_kind="final_only", stop=["x"]), []).lazy
    assert lazy_deltas[:-1] == [""] * len(ids) and lazy_deltas[-1] == "".join(deltas) == lazy.text
    prefix = ids[:cut]  # an abort after `cut` tokens
    part_eager = IncrementalDetokenizer(tok, eager_params, tok.encode("User: hi\n"))
    released = "".join(part_eager.step([t])[0] for t in prefix)
    part_lazy = IncrementalDetokenizer(tok, lazy_params, tok.encode("User: hi\n"))
    for t in prefix:
        part_lazy.step([t])
    assert part_lazy.catch_up() == released


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT, stop=st.text(alphabet=st.sampled_from(list("ab 你🙂\n")), min_size=1, max_size=4),
       include=st.booleans(), insert_at=st.none() | st.integers(0, 40))
def test_stop_strings_never_leak_and_cut_at_the_first_match(tok, text, stop, include, insert_at):
    text = text.replace("\ufffd", "")
    if insert_at is not None:  # make matches common, anywhere in the text
        text = text[:insert_at] + stop + text[insert_at:]
    params = SamplingParams(stop=[stop, "zz"], include_stop_str_in_output=include)
    ids = tok.encode(text)
    deltas, stopped, detok = stream(tok, ids, params)
    full = decode(tok, ids)
    first = min((i for i in (full.find(stop), full.find("zz")) if i != -1), default=-1)
    if first == -1:
        assert stopped is None and "".join(deltas) == full
        return
    matched = stop if full.find(stop) == first else "zz"
    expected = full[: first + len(matched)] if include else full[:first]
    assert stopped is not None and detok.stop_str == matched
    assert detok.text == expected == "".join(deltas)
    if not include:
        assert all(s not in "".join(deltas) for s in params.stop)


def test_stop_string_spanning_several_tokens_is_held_back_then_cut(tok):
    text = "the model 你好🙂 STOP here"
    ids = tok.encode(text)
    params = SamplingParams(stop=["你好🙂 ST"])
    deltas, stopped, detok = stream(tok, ids, params)
    stop_ids = tok.encode("你好🙂 ST")
    assert len(stop_ids) > 2  # the stop string really spans tokens
    assert stopped is not None and detok.text == "the model " == "".join(deltas)
    assert all("你" not in d for d in deltas)
    # The same request ending by max_tokens first: held-back text comes out in flush.
    partial = tok.encode("the model 你好")
    detok = IncrementalDetokenizer(tok, params, [])
    streamed = "".join(detok.step([t])[0] for t in partial)
    assert streamed == "the model " and streamed + detok.flush() == "the model 你好"


def test_include_stop_str_in_output(tok):
    ids = tok.encode("one two three four")
    deltas, stopped, detok = stream(tok, ids, SamplingParams(stop=["three"], include_stop_str_in_output=True))
    assert stopped is not None and "".join(deltas) == detok.text == "one two three"
    assert detok.step(tok.encode(" more")) == ("", True)  # finished: further tokens are ignored


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tok, skip):
    eos = tok.convert_tokens_to_ids(SPECIALS[0])
    ids = tok.encode("hello 你好") + [eos] + tok.encode(" world") + [tok.convert_tokens_to_ids(SPECIALS[1])]
    deltas, _, detok = stream(tok, ids, SamplingParams(skip_special_tokens=skip))
    assert "".join(deltas) == detok.text == decode(tok, ids, skip)
    assert (SPECIALS[0] in detok.text) is not skip


def test_no_tokenizer_means_no_text(tok):
    detok = IncrementalDetokenizer(None, SamplingParams(stop=["a"]), [1, 2])
    assert detok.step([3, 4]) == ("", False) and detok.flush() == "" and detok.text == ""


def test_prompt_context_does_not_leak_into_output(tok):
    prompt = tok.encode("你好🙂 the model")
    ids = tok.encode(" writes 世界")
    deltas, _, detok = stream(tok, ids, SamplingParams(), prompt)
    assert "".join(deltas) == detok.text == " writes 世界"


def _naive_first_match(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(start, stop) of the earliest match, first listed on a tie: the specification."""
    found = [(text.find(s), k, s) for k, s in enumerate(stops) if s in text]
    return min(found)[::2] if found else None


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.text(alphabet="abc", max_size=6), max_size=8),
       stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=5), min_size=1, max_size=4))
def test_stop_matcher_equals_a_naive_search_over_the_whole_text(pieces, stops):
    from lmforge.engine.detokenizer import StopMatcher

    m, text = StopMatcher(stops), ""
    for piece in pieces:
        got = m.feed(piece)
        before, text = text, text + piece
        want = _naive_first_match(text, stops)
        if got is not None:
            end, stop = got
            assert want is not None and (len(before) + end - len(stop), stop) == want
            return
        assert want is None  # nothing matched so far
        held = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        assert m.held_back() == held


def test_long_stop_strings_hold_back_their_longest_partial_match():
    """64 stop strings of 2,000 characters fed one character at a time (the old window search and
    prefix test did ~10^9 character comparisons here; KMP does ~64 x 400 state updates)."""
    from lmforge.engine.detokenizer import StopMatcher

    stops = [("ab" * 1000)[:-1] + chr(ord("c") + k % 20) for k in range(64)]
    m = StopMatcher(stops)
    for i in range(400):
        assert m.feed("ab"[i % 2]) is None
    assert m.held_back() == 400
    assert m.feed("ab" * 800) is None and m.held_back() == 1998  # "abab...ab" vs "abab...a" + c
    assert m.feed("ad") == (2, stops[1])  # 1999 characters of "abab...a", then stops[1]'s last one
