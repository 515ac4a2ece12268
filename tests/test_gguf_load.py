"""GGUF files as lmforge models (`lmforge.quant.gguf_load`): a tiny Llama exported by `lmforge export
--format gguf` (q8_0, q4_0, bf16) loads with its codes intact, runs on the integer kernels, and greedy
output equals the dequantized reference (A16) / the original folder (bf16); the tokenizer and chat
template come from the file's metadata; a K-quant tensor takes `gguf.quants.dequantize`."""

from __future__ import annotations

import json
import types

import gguf
import numpy as np
import pytest
import torch

from lmforge.engine import LLM, SamplingParams, kernels
from lmforge.model.reference import save_hf_model
from lmforge.quant import load_pretrained
from lmforge.quant.gguf_export import export_gguf, read_gguf
from lmforge.quant.gguf_load import _float, unpermute_qk
from lmforge.quant.linear import QmmLinear, QuantizedLinear, quantized_linears
from lmforge.quant.load import checkpoint_info
from lmforge.quant.scheme import QuantScheme
from lmforge.tokenizer.load import load_tokenizer

LIB = kernels.load()
TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
PROMPTS = ["def fib(n):", "return fib"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("gguf_load")
    path = save_hf_model("llama", root / "m", seed=3, hidden_size=64, vocab_size=320)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|pad|>", "<|bos|>", "<|eos|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    out = {"folder": path}
    for t in ("q8_0", "q4_0", "bf16"):
        out[t] = export_gguf(path, root / f"m-{t}.gguf", t)["file"]
    return out


def _greedy(model: str, **kw) -> tuple[list[list[int]], str]:
    llm = LLM(model, device="cpu", **kw)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], llm.llm_engine.stats()["linear_backend"]


@pytest.mark.parametrize("gguf_type,bits", [("q8_0", 8), ("q4_0", 4)])
def test_codes_are_the_files(files, gguf_type, bits):
    """Every Q8_0/Q4_0 matrix but the embedding is a QuantizedLinear in groups of 32 whose dequantized
    weight is gguf's own dequantization of the stored blocks, bit for bit (q/k un-permuted)."""
    model = load_pretrained(files[gguf_type], dtype="float32", device="cpu")
    _, tensors = read_gguf(files[gguf_type])
    layers = {next(n for n, m in model.named_modules() if m is q): q for _, _, q in quantized_linears(model)}
    assert len(layers) == 15 and all(q.scheme == QuantScheme(bits, 32) for q in layers.values())
    assert model.gguf_summary["tensors"][f"{gguf_type.upper()} codes"] == 15
    heads = {"q_proj": 4, "k_proj": 2}
    for name, ggml in (("model.layers.0.self_attn.q_proj", "blk.0.attn_q.weight"),
                       ("model.layers.1.self_attn.k_proj", "blk.1.attn_k.weight"),
                       ("model.layers.1.mlp.down_proj", "blk.1.ffn_down.weight"), ("lm_head", "output.weight")):
        want = torch.from_numpy(tensors[ggml])
        if name.rpartition(".")[2] in heads:
            want = unpermute_qk(want, heads[name.rpartition(".")[2]])
        assert torch.equal(layers[name].dequantized_weight(), want), name
    assert checkpoint_info(files[gguf_type]) == (None, True)


@pytest.mark.skipif(LIB is None, reason="no C compiler: lmforge's CPU kernels are absent")
@pytest.mark.parametrize("gguf_type", ["q8_0", "q4_0"])
def test_greedy_on_integer_kernels_equals_dequantized_reference(files, gguf_type):
    """dtype auto: float32 activations on `lmf_qmm_f32` over the file's codes; the reference engine
    dequantizes them into a dense weight (A16): same greedy tokens."""
    fast, backend = _greedy(files[gguf_type])
    ref, ref_backend = _greedy(files[gguf_type], attention="reference")
    assert "lmf_qmm_f32" in backend and ref_backend == "dequantize + matmul"
    assert fast == ref


def test_bf16_file_equals_the_folder(files):
    """A bf16 GGUF runs as floats: greedy equals the original folder loaded in bfloat16."""
    got, backend = _greedy(files["bf16"], dtype="bfloat16")
    want, _ = _greedy(str(files["folder"]), dtype="bfloat16")
    assert backend == "dense" and got == want
    assert checkpoint_info(files["bf16"]) == ("bfloat16", False)


def test_tokenizer_and_chat_template_from_metadata(files):
    ours, theirs = load_tokenizer(files["q8_0"]), load_tokenizer(files["folder"])
    text = "def fib(n): return n if n < 2"
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
    assert ours.chat_template == TEMPLATE
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs, tokenize=False) == "<|user|>hi"
    outs = LLM(files["q8_0"], device="cpu").generate(["def fib"], SamplingParams(temperature=0, max_tokens=4))
    assert outs[0].outputs[0].text == ours.decode(outs[0].outputs[0].token_ids)  # the engine detokenizes with it


def test_k_quant_tensor_is_dequantized_with_gguf():
    """Q6_K (what Q4_K_M files keep for some matrices): `gguf.quants.quantize` cannot write it, so random
    blocks with a sane scale stand in; the loader's float path equals gguf's dequantization, oriented
    (out, in)."""
    rng = np.random.default_rng(0)
    N, K = 6, 512
    block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q6_K][1]
    raw = rng.integers(0, 256, (N, K // 256, block_bytes), dtype=np.uint8)
    raw[..., -2:] = np.full((N, K // 256, 1), 0.01, np.float16).view(np.uint8)  # d: the block's f16 scale
    data = raw.reshape(N, -1)
    t = types.SimpleNamespace(tensor_type=gguf.GGMLQuantizationType.Q6_K, data=data, shape=np.array([K, N]))
    got = _float(t)
    want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q6_K)
    assert got.shape == (N, K) and torch.equal(got, torch.from_numpy(want))
    assert got.abs().max() > 0


@pytest.mark.skipif(LIB is None, reason="no C compiler: lmforge's CPU kernels are absent")
def test_int8_groups_of_32_on_both_kernels():
    """The Q8_0 layout (int8, a scale per 32 inputs): `lmf_qmm_f32` equals the dequantized matmul and
    every A8 body equals the portable one; before, int8 meant one scale per row in both kernels."""
    torch.manual_seed(0)
    K, N = 256, 40
    q = QuantizedLinear(K, N, QuantScheme(8, 32), scale_dtype=torch.float32)
    q.qweight.copy_(torch.randint(-127, 128, (N, K), dtype=torch.int8))
    q.weight_scale.copy_(torch.rand(N, K // 32) * 0.01 + 1e-3)
    x = torch.randn(3, K)
    want = x @ q.dequantized_weight().T
    layer = QmmLinear(q, torch.float32, qmm=LIB.qmm_f32)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    portable = QmmLinear(q, torch.float32, a8=LIB.a8("portable")).forward_a8(x)
    assert (portable - want).abs().max() < 0.02 * want.abs().max()  # int8 activations: an approximation
    for isa in LIB.a8_isas():
        torch.testing.assert_close(QmmLinear(q, torch.float32, a8=LIB.a8(isa)).forward_a8(x), portable,
                                   rtol=1e-5, atol=1e-5)


def test_refusals_name_the_file_and_field(files, tmp_path):
    from lmforge.quant.gguf_load import hf_config

    meta = {"general.architecture": "llama", "llama.attention.head_count": 4, "llama.embedding_length": 64}
    with pytest.raises(ValueError, match="rope.scaling.type='yarn'"):
        hf_config({**meta, "llama.rope.scaling.type": "yarn"}, tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="rope_freqs"):
        hf_config(meta, tmp_path / "x.gguf", {"rope_freqs.weight"})
    with pytest.raises(ValueError, match="lacks llama.feed_forward_length"):
        hf_config({**meta, "llama.vocab_size": 320}, tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="general.architecture='gpt2'"):
        hf_config({"general.architecture": "gpt2"}, tmp_path / "x.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="bad.gguf: not a readable GGUF file"):
        load_pretrained(tmp_path / "bad.gguf")
