"""Structured outputs and logit_bias through the offline `LLM`, on a tiny random model with a trained
tokenizer: a model that, left alone, emits garbage (checked), so every valid output is the grammar's work.

    python -m pytest -q tests/test_engine_structured.py
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
import torch

from lmforge.engine import LLM, EngineConfig, ProcessAsyncLLMEngine, SamplingParams
from lmforge.engine.sampling_params import StructuredOutputsParams as SO
from lmforge.engine.structured import unpack_banned_numpy, unpack_banned_torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                                   "vip": {"type": "boolean"}},
                  "required": ["zip", "vip"], "additionalProperties": False},
    },
    "required": ["name", "kind", "age", "tags", "owner"],
    "additionalProperties": False,
}
PROMPTS = ["The city of", "model token server", "Hello there", "import data"]


@pytest.fixture(scope="module")
def llm(chat_model_dir, one_thread):
    return LLM(str(chat_model_dir), device="cpu", block_size=4)


def texts(llm, prompts, params) -> list:
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("compact", [False, True])
def test_every_output_under_a_nested_schema_validates(llm, compact):
    # the default bounds JSON whitespace (JSON_WHITESPACE): with JSON's own rule this random model pads with
    # whitespace until max_tokens (docs/structured-outputs.md's first example failed so, in LLM.generate)
    so = SO(json=SCHEMA, disable_any_whitespace=True) if compact else SO(json=SCHEMA)
    params = [SamplingParams(temperature=0.0, max_tokens=160, structured_outputs=so)] + [
        SamplingParams(temperature=1.0, seed=s, max_tokens=160, structured_outputs=so) for s in range(5)]
    outs = texts(llm, PROMPTS[:2] * 3, params)
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
    outside_strings = [re.sub(r'"(?:[^"\\]|\\.)*"', "", o.text) for o in outs]
    assert compact == all(not re.search(r"\s", t) for t in outside_strings)
    gaps = [g for o in outs for g in re.findall(r"\s+", re.sub(r'"(?:[^"\\]|\\.)*"', "S", o.text))]
    assert all(re.fullmatch(r"[ \n]{1,2}", g) for g in gaps) and (compact or gaps)
    free = texts(llm, PROMPTS[:2], SamplingParams(temperature=1.0, seed=0, max_tokens=60))
    with pytest.raises(json.JSONDecodeError):  # the same model, unconstrained: garbage
        json.loads(free[0].text)


def test_json_object_regex_choice_and_grammar(llm):
    kinds = [SO(json_object=True, disable_any_whitespace=True), SO(regex=r"[0-9]{3}-[a-z]{2,5}"),
             SO(choice=["yes", "no", "maybe not"]), SO(grammar='start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/')]
    # JSON mode bounds no string: a logit_bias towards '"' and '}' (which the grammar still polices)
    # lets the random model finish its object within max_tokens
    encode = llm.get_tokenizer().encode
    closers = {encode(c, add_special_tokens=False)[0]: 6.0 for c in ('"', "}")}
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=120, structured_outputs=k,
                             logit_bias=closers if k.json_object else None) for k in kinds for s in range(3)]
    outs = texts(llm, [PROMPTS[s] for _ in kinds for s in range(3)], params)
    for o in outs:
        assert o.finish_reason == "stop", o.text
    assert all(isinstance(json.loads(o.text), dict) for o in outs[0:3])
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", o.text) for o in outs[3:6])
    assert all(o.text in ("yes", "no", "maybe not") for o in outs[6:9])
    assert all(re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})*\)", o.text) for o in outs[9:12])


def test_constrained_and_unconstrained_rows_share_a_batch(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = texts(llm, PROMPTS, plain)
    choice = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=SO(choice=["red", "green"]))
    mixed = texts(llm, [p for q in PROMPTS for p in (q, q)], [plain, choice] * len(PROMPTS))
    assert [o.token_ids for o in mixed[0::2]] == [o.token_ids for o in alone]  # untouched by their neighbours
    assert all(o.text in ("red", "green") for o in mixed[1::2])


def test_prefix_cache_and_preemption_keep_the_grammar_consistent(chat_model_dir, one_thread):
    """Preemption by recompute keeps the output tokens, and the matcher has consumed exactly those: a
    pool so small that sequences are preempted mid-JSON gives the same tokens as a roomy one."""
    so = SO(json=SCHEMA, disable_any_whitespace=True)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=100, structured_outputs=so, n=2) for s in range(4)]
    prompts = ["The city of the river and the school"] * 4  # one prompt: its blocks come from the prefix cache
    roomy = LLM(str(chat_model_dir), device="cpu", block_size=4)
    tight = LLM(str(chat_model_dir), device="cpu", block_size=4, num_kv_blocks=40)
    expected = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params, use_tqdm=False)]
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.stats()["preemptions"] > 0 and tight.stats()["prefix_cache_hits"] > 0
    assert [[c.token_ids for c in o.outputs] for o in got] == expected
    for o in got:
        for c in o.outputs:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.text), SCHEMA)


@pytest.mark.parametrize("so, match", [
    (SO(json={"type": "array", "items": {"type": "integer"}, "uniqueItems": True}), "uniqueItems"),
    (SO(json={"type": "string", "format": "bogus"}), "Unknown format: bogus"),
    (SO(json='{"type": "object"'), "structured_outputs.json: not valid JSON"),
    (SO(regex="(unclosed"), "unclosed group"),
    (SO(grammar="start: foo"), "unknown name"),
    (SO(json={"$ref": "#"}), "cannot run: it matches no text"),  # issue 43: compiled, then aborted at token 1
    (SO(choice=[f"c{i}" for i in range(3000)]), "cannot run: .*2,000 alternatives"),
])
def test_a_spec_that_cannot_compile_is_refused_naming_the_problem(llm, so, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["x"], SamplingParams(structured_outputs=so), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # nothing was queued


def test_bitmask_unpacks_to_llguidance_own_per_token_mask(llm):
    """The fast path (int32 words unpacked with tensor ops) against llguidance's byte-per-token mask, on
    a batch where row 1 is unconstrained, along a JSON text, including ids past bit 31 of a word."""
    engine = llm.llm_engine
    grammar = engine.structured.grammar_for(SO(json=SCHEMA))
    text = '{"name": "ab", "kind": "dog", "age": 42, "tags": ["x"], "owner": {"zip": "12345", "vip": true}}'

    class Row:
        def __init__(self, g):
            self.grammar = g

    V, words = engine.vocab_size, []
    for token in llm.get_tokenizer().encode(text, add_special_tokens=False):
        banned_SV = engine.structured.banned_tokens([Row(grammar), Row(None)], torch.device("cpu"))
        reference_V = torch.frombuffer(bytearray(grammar.matcher.compute_logit_bias()), dtype=torch.uint8)[:V] == 0
        assert torch.equal(banned_SV[0], reference_V) and not banned_SV[1].any()
        assert not banned_SV[0, token] and grammar.accept(token)
        words.append(engine.structured._bitmask(2).clone())
    for bitmask_SW in words:  # the numpy path (CPU) and the tensor path (CUDA) agree
        assert torch.equal(unpack_banned_numpy(bitmask_SW, V), unpack_banned_torch(bitmask_SW, V))
    words_1W = torch.tensor([[-1, -(2**31), 0b101]], dtype=torch.int32)  # all; only bit 31 (sign); bits 0, 2
    allowed = set(range(32)) | {63, 64, 66}
    expected_V = torch.tensor([t not in allowed for t in range(70)])
    assert torch.equal(unpack_banned_numpy(words_1W, 70)[0], expected_V)
    assert torch.equal(unpack_banned_torch(words_1W, 70)[0], expected_V)
    assert grammar.is_terminated and not grammar.error


def test_specs_compile_once(llm):
    cache = llm.llm_engine.structured._compile
    so = SO(regex=r"[a-c]{4}")
    texts(llm, ["x"], SamplingParams(max_tokens=8, structured_outputs=so))
    misses = cache.cache_info().misses
    again = SamplingParams(temperature=1.0, max_tokens=8, structured_outputs=SO(regex=r"[a-c]{4}"))  # equal, not same
    outs = texts(llm, ["x", "y", "z"], again)
    assert cache.cache_info().misses == misses
    assert all(re.fullmatch("[a-c]{4}", o.text) for o in outs)


def test_logit_bias_through_the_engine(llm):
    base = texts(llm, ["The city of"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    forced = (base.token_ids[0] + 7) % 300 + 10
    out = texts(llm, ["The city of"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                     logit_bias={str(forced): 100}))[0]
    assert out.token_ids == [forced] * 6
    banned = texts(llm, ["The city of"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                        logit_bias={t: -100 for t in base.token_ids}))[0]
    assert not set(banned.token_ids) & set(base.token_ids)
    V = llm.llm_engine.vocab_size
    with pytest.raises(ValueError, match=f"token id {V + 3} is not in the vocabulary"):
        llm.generate(["x"], SamplingParams(logit_bias={V + 3: 1}), use_tqdm=False)


def test_structured_outputs_params_are_validated():
    for bad, match in [({}, "set exactly one of"), ({"json": {}, "regex": "a"}, "got json, regex"),
                       ({"choice": []}, "non-empty list"), ({"regex": 5}, "non-empty string"),
                       ({"shape": 1}, "unknown field\\(s\\) shape")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(structured_outputs=bad)
    assert SamplingParams(structured_outputs={"choice": ("a", "b")}).structured_outputs.choice == ["a", "b"]


def test_through_the_engine_core_process(chat_model_dir, one_thread):
    """The server's engine runs in a child process: the params cross a pipe, and so does a refusal."""
    engine = ProcessAsyncLLMEngine(EngineConfig(model=str(chat_model_dir), device="cpu"))
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=120, logit_bias={"5": -100},
                            structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})

    async def last(prompt, p):
        out = None
        async for out in engine.generate(prompt, p, f"r-{prompt}"):
            pass
        return out.outputs[0]

    try:
        out = asyncio.run(last("The city of", params))
        assert out.finish_reason == "stop" and 5 not in out.token_ids
        jsonschema.validate(json.loads(out.text), SCHEMA)
        bad = SamplingParams(structured_outputs={"json": {"type": "array", "uniqueItems": True}})
        with pytest.raises(ValueError, match="uniqueItems"):
            asyncio.run(last("x", bad))
    finally:
        engine.shutdown()
