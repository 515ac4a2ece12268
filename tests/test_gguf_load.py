"""GGUF files as lmforge models (`lmforge.quant.gguf_load`): a tiny Llama exported by `lmforge export
--format gguf` (q8_0, q4_0, bf16) loads with its codes intact, runs on the integer kernels, and greedy
output equals the dequantized reference (A16) / the original folder (bf16); the tokenizer and chat
template come from the file's metadata; a K-quant tensor takes `gguf.quants.dequantize`."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from lmforge.engine import LLM, SamplingParams, kernels
from lmforge.model.reference import save_hf_model
from lmforge.quant import load_pretrained
from lmforge.quant.gguf_export import export_gguf, read_gguf
from lmforge.quant.gguf_file import GGUFFile
from lmforge.quant.gguf_load import quantized_linear, unpermute_qk
from lmforge.quant.gguf_types import UNPACK
from lmforge.quant.linear import QmmLinear, QuantizedLinear, quantized_linears
from lmforge.quant.load import checkpoint_info
from lmforge.quant.scheme import QuantScheme, dequantize
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


@pytest.mark.parametrize("gguf_type", ["q8_0", "q4_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_untied_embedding_looks_up_the_files_blocks(files, gguf_type, dtype):
    """An untied quantized embedding stays the file's blocks (`BlockEmbedding`, nothing repacked at load): any
    lookup, in any order and shape, is gguf's own dequantization of those rows, cast to the model's dtype."""
    from lmforge.quant.gguf_load import BlockEmbedding

    model = load_pretrained(files[gguf_type], dtype=str(dtype)[6:], device="cpu")
    _, tensors = read_gguf(files[gguf_type])
    table = model.model.embed_tokens
    assert isinstance(table, BlockEmbedding) and table.blocks.dtype == torch.uint8
    want = torch.from_numpy(tensors["token_embd.weight"]).to(dtype)
    ids = torch.tensor([[5, 0, 319], [7, 7, 300]])
    assert torch.equal(table(ids), want[ids])
    assert torch.equal(table(torch.arange(320)), want)


@pytest.mark.skipif(LIB is None, reason="no C compiler: lmforge's CPU kernels are absent")
@pytest.mark.parametrize("gguf_type", ["q8_0", "q4_0"])
def test_greedy_on_integer_kernels_equals_dequantized_reference(files, gguf_type):
    """dtype auto: float32 activations on `lmf_qmm_f32` over the file's codes; the reference engine
    dequantizes them into a dense weight (A16): same greedy tokens."""
    fast, backend = _greedy(files[gguf_type], quant_activations="none")
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


def _random_blocks(qtype, N: int, K: int, seed: int = 0) -> np.ndarray:
    """(N, bytes a row) of random blocks of `qtype` whose f16 fields (scales, mins) are sane finite values."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (N, K // block, size), dtype=np.uint8)
    Q = gguf.GGMLQuantizationType
    f16_at = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q5_0: [0], Q.Q4_1: [0, 2], Q.Q5_1: [0, 2], Q.Q4_K: [0, 2],
              Q.Q5_K: [0, 2], Q.Q6_K: [size - 2]}[qtype]
    for at in f16_at:
        vals = rng.uniform(-0.05, 0.05, (N, K // block)).astype(np.float16)
        raw[..., at:at + 2] = vals[..., None].view(np.uint8)
    return raw.reshape(N, -1)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_block_types_unpack_to_codes_that_dequantize_bit_for_bit(name):
    """Every block type lmforge keeps as codes: `scale * code (+ zero)` equals `gguf.quants.dequantize`
    (llama.cpp's reference) bit for bit on random blocks, codes within the scheme's range."""
    qtype = gguf.GGMLQuantizationType[name]
    N, K = 6, 512
    data = _random_blocks(qtype, N, K)
    g = UNPACK[qtype](data)
    want = gguf.quants.dequantize(data, qtype)
    # 4-, 5- and 6-bit codes come packed at their bits as the kernels read them, 8-bit ones a byte each
    bits = g.scheme.num_bits
    assert g.codes.shape == (N, K * bits // 8) and g.packed == (bits < 8)
    assert g.scale.shape == (N, K // g.scheme.group_size)
    np.testing.assert_array_equal(g.dequantize(), want)
    lo, hi = (0, 2 ** g.scheme.num_bits - 1) if g.scheme.zero_point else (g.scheme.qmin, g.scheme.qmax)
    codes = g.int8_codes()
    assert codes.shape == (N, K) and codes.min() >= lo and codes.max() <= hi and np.abs(want).max() > 0
    # the QuantizedLinear the loader installs dequantizes to the same numbers, and so does a lookup of some rows
    # (a tied embedding's: `rows`), in any order and with repeats
    q = quantized_linear(g)
    assert torch.equal(q.dequantized_weight(), torch.from_numpy(want))
    idx = torch.tensor([4, 0, 4, 5])
    codes, scales, zeros = q.rows(idx)
    assert torch.equal(dequantize(codes, scales, torch.float32, zeros), torch.from_numpy(want)[idx])


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
    with pytest.raises(ValueError, match="bad.gguf: not a (valid )?GGUF file"):
        load_pretrained(tmp_path / "bad.gguf")


def _corrupt_copies(good: bytes) -> dict[str, bytes]:
    """Damaged copies of a valid file: empty, wrong magic/version, truncated at points through the header
    and the data, and header fields (counts, a string length, a tensor's dims, type, offset) overwritten."""
    import struct

    kv0 = 24  # the first metadata key's length
    out = {"empty": b"", "magic": b"GGUX" + good[4:], "version": good[:4] + struct.pack("<I", 9) + good[8:],
           "tensor count": good[:8] + struct.pack("<Q", 2**40) + good[16:],
           "metadata count": good[:16] + struct.pack("<Q", 2**40) + good[24:],
           "key length": good[:kv0] + struct.pack("<Q", 2**50) + good[kv0 + 8:]}
    for frac in (0.001, 0.01, 0.05, 0.2, 0.5, 0.9, 0.999):
        out[f"truncated at {frac}"] = good[:int(len(good) * frac)]
    return out


def test_corrupt_files_are_one_clear_error_naming_the_file(files, tmp_path):
    """Every damaged copy of a valid GGUF stops at open with a ValueError naming the file and the fault
    (never an IndexError or a numpy reshape error); the data section's tail cut off is caught too."""
    from pathlib import Path

    good = Path(files["q8_0"]).read_bytes()
    hdr = GGUFFile(files["q8_0"])
    t = next(iter(hdr.tensors.values()))
    copies = _corrupt_copies(good)
    at = good.index(t.name.encode()) + len(t.name)  # the tensor info: n_dims, dims, type, offset
    import struct
    copies["tensor dims"] = good[:at + 4] + struct.pack("<Q", 2**62) + good[at + 12:]
    copies["tensor type"] = good[:at + 4 + 8 * len(t.dims)] + struct.pack("<I", 999) + good[at + 8 + 8 * len(t.dims):]
    copies["tensor offset"] = (good[:at + 8 + 8 * len(t.dims)] + struct.pack("<Q", 2**40)
                               + good[at + 16 + 8 * len(t.dims):])
    assert len(copies) >= 13
    for what, data in copies.items():
        bad = tmp_path / f"bad-{what.replace(' ', '-')}.gguf"
        bad.write_bytes(data)
        with pytest.raises(ValueError) as e:
            load_pretrained(bad, dtype="float32", device="cpu")
        assert str(bad) in str(e.value) and "\n" not in str(e.value), (what, str(e.value))
        assert "GGUF" in str(e.value), (what, str(e.value))


@pytest.mark.skipif(LIB is None, reason="no C compiler: lmforge's CPU kernels are absent")
@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_block_types_run_on_every_kernel_body(name):
    """Each block type on lmforge's kernels as the loader installs it: the A16 row kernel and the panel GEMM
    equal a float64 matmul of the dequantized weight (float32 rounding only), and every int8-activation body
    equals the portable one, which is within int8 activation error of the reference."""
    qtype = gguf.GGMLQuantizationType[name]
    N, K = 40, 512
    g = UNPACK[qtype](_random_blocks(qtype, N, K, seed=1))
    q = quantized_linear(g)
    assert QmmLinear.supports(q, torch.device("cpu"), torch.float32)
    torch.manual_seed(0)
    w64 = torch.from_numpy(g.dequantize()).double()
    for M in (1, 3, 24):  # decode rows on the row kernel; 24 rows on the panel GEMM (c_gemm)
        x = torch.randn(M, K)
        want = x.double() @ w64.T
        tol = 1e-5 * want.abs().max().item()
        for c_gemm in (False, True):
            got = QmmLinear(q, torch.float32, qmm=LIB.qmm_f32, c_gemm=c_gemm)(x)
            assert (got.double() - want).abs().max().item() <= tol, (M, c_gemm)
        portable = QmmLinear(q, torch.float32, a8=LIB.a8("portable")).forward_a8(x)
        assert (portable.double() - want).abs().max() < 0.03 * want.abs().max(), M  # int8 activations
        for isa in LIB.a8_isas():
            got = QmmLinear(q, torch.float32, a8=LIB.a8(isa)).forward_a8(x)
            torch.testing.assert_close(got, portable, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    # the dequantized weight the bf16 prefill and the fallback use is the file's, up to the zero's rounding
    layer = QmmLinear(q, torch.float32, qmm=LIB.qmm_f32)
    assert (layer.dequantized().double() - w64).abs().max() <= 1e-6 * w64.abs().max()


@pytest.mark.parametrize("bits", [5, 6])
def test_five_and_six_bit_codes_pack_as_the_kernels_read_them(bits):
    """`pack_lohi` / `unpack_lohi` round trip, and a layer given one code a byte packs to the same kernel bytes
    (and results) as the loader's packed form."""
    from lmforge.quant.scheme import pack_lohi, unpack_lohi

    rng = np.random.default_rng(bits)
    N, K = 8, 256
    u = rng.integers(0, 2 ** bits, (N, K), dtype=np.uint8)
    p = pack_lohi(u, bits)
    assert p.shape == (N, K * bits // 8) and np.array_equal(unpack_lohi(p, bits, K), u)
    assert torch.equal(unpack_lohi(pack_lohi(torch.from_numpy(u), bits), bits, K), torch.from_numpy(u))
    scheme = QuantScheme(bits, 32)
    packed = QuantizedLinear(K, N, scheme, scale_dtype=torch.float32, packed=True)
    packed.qweight.copy_(torch.from_numpy(p))
    plain = QuantizedLinear(K, N, scheme, scale_dtype=torch.float32)
    plain.qweight.copy_(torch.from_numpy(u.astype(np.int16) - (1 << (bits - 1))).to(torch.int8))
    for q in (packed, plain):
        q.weight_scale.copy_(torch.from_numpy(rng.random((N, K // 32), dtype=np.float32) * 0.01))
    plain.weight_scale.copy_(packed.weight_scale)
    assert torch.equal(plain.dequantized_weight(), packed.dequantized_weight())
    if LIB is not None:
        a, b = QmmLinear(packed, torch.float32, qmm=LIB.qmm_f32), QmmLinear(plain, torch.float32, qmm=LIB.qmm_f32)
        assert torch.equal(a.codes, b.codes)
        x = torch.randn(2, K)
        torch.testing.assert_close(a(x), x @ packed.dequantized_weight().T, rtol=1e-5, atol=1e-5)
