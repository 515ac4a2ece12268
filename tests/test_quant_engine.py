"""Quantized weights and an int8 KV cache in the engine: each CPU kernel against the dequantized
float32 matmul, greedy tokens against a plain model holding the dequantized weights, the int8 cache
against a float32 reference, and the pool capacity at a fixed KV byte budget."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmforge.engine import LLM, SamplingParams
from lmforge.engine.attention import Int8KVPool, KVPool, ReferenceBackend, SdpaBackend, quantize_kv
from lmforge.model.reference import save_hf_model
from lmforge.quant import QuantScheme, load_pretrained, quantize_rtn
from lmforge.engine import kernels
from lmforge.quant.linear import DequantLinear, Int4Linear, Int8Linear, QmmLinear, QuantizedLinear, quantized_linears
from lmforge.quant.quantize import QuantizeConfig, quantize_model

PROMPTS = [[1, 5, 9, 33, 100, 7, 8, 9], [3, 4, 5], list(range(10, 200, 9)), [42] * 5]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _quantized_linear(scheme: QuantScheme, N: int = 48, K: int = 128, bias: bool = True) -> QuantizedLinear:
    g = torch.Generator().manual_seed(scheme.num_bits)
    q = QuantizedLinear(K, N, scheme, bias=bias, scale_dtype=torch.float32)
    qw, s = quantize_rtn(torch.randn(N, K, generator=g), scheme, torch.float32)
    q.qweight.copy_(qw)
    q.weight_scale.copy_(s)
    if bias:
        q.bias.data.normal_(generator=g)
    return q


@pytest.mark.parametrize("cls,scheme", [(Int8Linear, QuantScheme(8, None)), (Int4Linear, QuantScheme(4, 32)),
                                        (Int4Linear, QuantScheme(4, 128))], ids=["int8", "int4-g32", "int4-g128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_dequantized_float32_matmul(cls, scheme, dtype):
    q = _quantized_linear(scheme)
    assert cls.supports(q, torch.device("cpu"))
    layer = cls(q, dtype)
    for M in (1, 5, 33):
        x = torch.randn(2, M, 128, generator=torch.Generator().manual_seed(M)).to(dtype)
        ref = x.float() @ q.dequantized_weight().t() + q.bias
        got = layer(x)
        assert got.dtype == dtype and got.shape == (2, M, 48)
        # the kernels take bf16 activations: error of one bf16 rounding of x and of the output
        err = (got.float() - ref).abs().max() / ref.abs().max()
        assert err < 2e-2, err


@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("scheme,K", [(QuantScheme(8, None), 128), (QuantScheme(8, None), 200),
                                      (QuantScheme(4, 32), 128), (QuantScheme(4, 128), 256), (QuantScheme(4, 64), 192)],
                         ids=["int8", "int8-tail", "int4-g32", "int4-g128", "int4-g64"])
def test_qmm_kernel_matches_dequantized_float32_matmul(scheme, K, build, tmp_path):
    """lmf_qmm_f32 (float32 activations, int8 / packed int4 codes): the same products as the dequantized
    float32 matmul, in another summation order; without `c_gemm` rows up to `MAX_ROWS` run the row kernel,
    more rows dequantize + sgemm; with it, from `GEMM_MIN_ROWS` rows on the panel GEMM (`lmf_gemm_f32`,
    AVX2 builds; the portable one has none and keeps the row kernel).
    The portable body (-DLMF_PORTABLE: plain C) is checked too: it is what a CPU without AVX2 runs."""
    if build == "native":
        lib = kernels.load()
        if lib is None:
            pytest.skip(f"no compiled kernels here: {kernels.status()}")  # the torch path is tested above
    else:
        lib = kernels._bind(kernels.build(("-DLMF_PORTABLE",), out_dir=tmp_path))
    q = _quantized_linear(scheme, N=40, K=K)
    assert QmmLinear.supports(q, torch.device("cpu"), torch.float32)
    assert not QmmLinear.supports(q, torch.device("cpu"), torch.bfloat16)
    for c_gemm in (False, True):
        layer = QmmLinear(q, torch.float32, qmm=lib.qmm_f32, c_gemm=c_gemm)
        assert layer.gemm_rows == (QmmLinear.GEMM_MIN_ROWS[scheme.num_bits] if c_gemm else 0)
        for M in (1, 2, 3, 4, 5, 8, 9, 12, 13, 23, 33):
            x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
            ref = x.double() @ q.dequantized_weight().double().t() + q.bias.double()
            got = layer(x)
            assert got.dtype == torch.float32 and got.shape == (M, 40)
            assert (got.double() - ref).abs().max() < 1e-4 * ref.abs().max(), (M, (got.double() - ref).abs().max())
    if scheme.num_bits == 4:
        assert layer.codes.dtype == torch.uint8 and layer.codes.shape == (40, K // 2)  # half a byte a weight
    if build == "native" and lib.gemm_ok and K % 32 == 0:
        # int8 activations up to A8_MAX_ROWS; a prefill chunk above takes the panel GEMM on float32 ones (exact),
        # or, on a CPU with the A8 panel GEMM (AVX-512 VNNI), stays on int8 activations (their rounding shows)
        a8 = QmmLinear(q, torch.float32, qmm=lib.qmm_f32, a8=lib.a8(), c_gemm=True)
        x = torch.randn(QmmLinear.A8_MAX_ROWS + 36, K, generator=torch.Generator().manual_seed(7))
        ref = x.double() @ q.dequantized_weight().double().t() + q.bias.double()
        err = (a8(x).double() - ref).abs().max() / ref.abs().max()
        assert (1e-5 < err < 2e-2) if a8.a8_panel else err < 1e-4, (a8.a8_panel, err)


@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("K", [128, 200])
def test_qmm_kernel_float32_weights(K, build, tmp_path):
    """lmf_qmm_f32 with bits 32 (`QmmLinear.from_f32`: a float32 model's decoder-layer linears): rows 1-4
    take the 4-row body, 5-8 the 8-row one (`f32_row8`), 9-16 both in turn; K = 200 leaves a tail under
    16 and 32; from `GEMM_MIN_ROWS[32]` rows the panel GEMM (`c_gemm`, native build) or above `MAX_ROWS` oneDNN on the same
    tensor. No copy of the weight is made."""
    if build == "native":
        lib = kernels.load()
        if lib is None:
            pytest.skip(f"no compiled kernels here: {kernels.status()}")
    else:
        lib = kernels._bind(kernels.build(("-DLMF_PORTABLE",), out_dir=tmp_path))
    lin = nn.Linear(K, 40, bias=True)
    torch.nn.init.normal_(lin.weight, generator=torch.Generator().manual_seed(K))
    for c_gemm in (False, True):  # above 16 rows oneDNN, or lmf_qmm_f32 all the way (its panel GEMM from GEMM_MIN_ROWS[32])
        layer = QmmLinear.from_f32(lin, lib.qmm_f32, max_rows=16, c_gemm=c_gemm and lib.gemm_ok)
        assert layer.bits == 32 and layer.codes.data_ptr() == lin.weight.data_ptr()
        for M in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 40):
            x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
            ref = x.double() @ lin.weight.detach().double().t() + lin.bias.detach().double()
            with torch.inference_mode():
                got = layer(x)
            assert got.dtype == torch.float32 and got.shape == (M, 40)
            assert (got.double() - ref).abs().max() < 1e-5 * ref.abs().max(), (M, (got.double() - ref).abs().max())
    with pytest.raises(ValueError, match="float32 CPU weight"):
        QmmLinear.from_f32(nn.Linear(K, 8).to(torch.bfloat16), lib.qmm_f32, max_rows=16)


def _dense_copy(quant_dir, out_dir) -> None:
    """The same model with every quantized linear replaced by an nn.Linear holding its dequantized weight."""
    model = load_pretrained(quant_dir, dtype="float32", device="cpu")
    for parent, name, q in quantized_linears(model):
        lin = nn.Linear(q.in_features, q.out_features, bias=q.bias is not None)
        lin.weight.data = q.dequantized_weight()
        if q.bias is not None:
            lin.bias.data = q.bias.data.float()
        setattr(parent, name, lin)
    model.save_pretrained(out_dir)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("qengine")
    src = save_hf_model("llama", root / "src", seed=5, hidden_size=128)
    out = {"src": src}
    for name, scheme, gs in (("w8", "w8a16", 128), ("w4", "w4a16", 32)):
        quantize_model(QuantizeConfig(model=str(src), out=str(root / name), scheme=scheme, group_size=gs))
        _dense_copy(root / name, root / f"{name}-dense")
        out[name], out[f"{name}-dense"] = root / name, root / f"{name}-dense"
    return out


def _greedy(path, **kw) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", device="cpu", **kw)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("name", ["w8", "w4"])
def test_greedy_equals_plain_model_with_dequantized_weights(models, name):
    """The reference linear backend is the same math as the dense copy: identical tokens."""
    assert _greedy(models[name], attention="reference") == _greedy(models[f"{name}-dense"], attention="reference")


@pytest.mark.parametrize("name,backend,cpu_kernels", [("w8", Int8Linear, False), ("w4", Int4Linear, False),
                                                      ("w8", QmmLinear, True), ("w4", QmmLinear, True)])
def test_fast_engine_picks_the_cpu_kernel_and_agrees(models, name, backend, cpu_kernels):
    """float32 activations: lmforge's compiled qmm kernel when the kernels are built, else torch's
    packed int8/int4 kernels (bf16 activations around the call)."""
    if backend is QmmLinear and kernels.load() is None:
        backend = Int8Linear if name == "w8" else Int4Linear  # no compiler here: torch's kernels
    llm = LLM(str(models[name]), dtype="float32", device="cpu", cpu_kernels=cpu_kernels, quant_activations="none")
    st = llm.stats()
    assert st["linear_backend"].removesuffix("; prefill on lmforge lmf_gemm_f32") == backend.name
    assert st["linear_backend"].endswith("lmf_gemm_f32") is bool(backend is QmmLinear and kernels.load().gemm_ok)
    # with the compiled kernels q/k/v and gate/up are one linear each (engine.fused.fuse_projections)
    fused = backend is QmmLinear
    assert llm.llm_engine.model_runner.quantized_linears == (4 if fused else 7) * 2
    assert llm.llm_engine.model_runner.fused_projections == (2 * 2 if fused else 0)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    want = _greedy(models[f"{name}-dense"])
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w)) / sum(len(w) for w in want)
    # torch's kernels take bf16 activations: rare near-ties may flip (measured: 1.0); qmm is float32 math
    assert same >= (0.95 if backend is QmmLinear else 0.75), same
    assert st["weight_bytes"] < 0.8 * LLM(str(models["src"]), dtype="float32", device="cpu").stats()["weight_bytes"]


def test_dequant_backend_when_a_kernel_does_not_fit():
    q = _quantized_linear(QuantScheme(4, 16))  # torch's int4 kernel takes groups of 32..256
    assert not Int4Linear.supports(q, torch.device("cpu"))
    m = nn.Sequential(q)
    from lmforge.quant.linear import select_backend

    assert select_backend(m, torch.device("cpu")) is DequantLinear


def test_int8_kv_decode_matches_float32_reference():
    """Paged decode over an int8 cache (fast gather path) against plain attention over the float32 K/V."""
    L, P, B, K, N, H = 1, 32, 4, 2, 4, 16
    g = torch.Generator().manual_seed(0)
    int8 = Int8KVPool(L, P, B, K, H, torch.float32, torch.device("cpu"))
    attn, ref = SdpaBackend(int8), ReferenceBackend(KVPool(L, P, B, K, H, torch.float32, torch.device("cpu")))
    tables, computed = [[3, 7, 1], [10, 11, 12, 13, 14], [20]], [9, 17, 2]
    # fill the cache: one prefill per sequence of its computed tokens
    kv = {i: (torch.randn(1, c, K, H, generator=g), torch.randn(1, c, K, H, generator=g))
          for i, c in enumerate(computed)}
    for a in (attn, ref):
        for i, c in enumerate(computed):
            a.prepare([tables[i]], [0], [c])
            a(0, torch.randn(1, c, N, H, generator=g), *kv[i])
    q = torch.randn(1, 3, N, H, generator=g)
    k, v = torch.randn(1, 3, K, H, generator=g), torch.randn(1, 3, K, H, generator=g)
    outs = []
    for a in (attn, ReferenceBackend(int8), ref):  # the int8 pool read by both backends, then float32
        a.prepare(tables, computed, [1, 1, 1])
        outs.append(a(0, q, k, v))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)  # fast == reference over the same codes
    err = (outs[0] - outs[2]).abs().max().item()
    assert 0 < err < 0.03, err  # int8 K/V: ~1/254 of each head's absmax per element


def test_quantize_kv_error_bound():
    x = torch.randn(50, 2, 64) * torch.rand(50, 2, 1) * 10
    q, s = quantize_kv(x)
    assert q.dtype == torch.int8 and s.shape == (50, 2)
    err = (q.float() * s.float()[..., None] - x).abs()
    assert bool((err <= s.float()[..., None] * 0.5 + 1e-6 + x.abs().amax(-1, keepdim=True) * 4e-3).all())


def test_int8_kv_doubles_the_pool_at_a_fixed_budget(tmp_path):
    path = save_hf_model("llama", tmp_path / "m", seed=1, hidden_size=256, num_attention_heads=4,
                         num_key_value_heads=2)  # head dim 64
    budget = 4 * 2**20
    base = LLM(str(path), dtype="bfloat16", device="cpu", kv_cache_memory_bytes=budget)
    int8 = LLM(str(path), dtype="bfloat16", device="cpu", kv_cache_memory_bytes=budget, kv_cache_dtype="int8")
    b, i = base.stats(), int8.stats()
    assert b["kv_bytes_per_token"] == 2 * 2 * 2 * 64 * 2 and i["kv_bytes_per_token"] == 2 * 2 * 2 * (64 + 2)
    assert i["kv_pool_tokens"] / b["kv_pool_tokens"] >= 1.9
    assert i["attention_backend"].endswith("int8 KV")
    outs = [LLM_out.outputs[0].token_ids for LLM_out in int8.generate(PROMPTS, GREEDY, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in base.generate(PROMPTS, GREEDY, use_tqdm=False)]
    same = sum(a == c for g, w in zip(outs, want) for a, c in zip(g, w)) / sum(len(w) for w in want)
    assert same >= 0.75, same


def test_kv_cache_dtype_is_validated(models):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(str(models["src"]), device="cpu", kv_cache_dtype="fp8")


@pytest.mark.parametrize("scheme", [QuantScheme(8, None), QuantScheme(4, 32)], ids=["int8", "int4-g32"])
def test_concatenated_projections_compute_the_same_numbers(scheme):
    """`fuse_projections`' q/k/v (and gate/up) as one linear: each output row is its own dot product, so
    the fused layer's outputs are bit for bit the separate layers' side by side, on the qmm kernel (A16
    and A8) and for float linears; a mismatch in scheme or input size is refused (None)."""
    from lmforge.engine.fused import concat_linears

    parts = [_quantized_linear(scheme, N=n, K=128) for n in (64, 32, 32)]
    fused = concat_linears(parts)
    assert isinstance(fused, QuantizedLinear) and fused.out_features == 128 and fused.bias is not None
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(3))
    lib = kernels.load()
    makers = [lambda q: DequantLinear(q, torch.float32)]
    if lib is not None:
        makers += [lambda q: QmmLinear(q, torch.float32, qmm=lib.qmm_f32),
                   lambda q: QmmLinear(q, torch.float32, a8=lib.a8())]
    for make in makers:
        assert torch.equal(make(fused)(x), torch.cat([make(q)(x) for q in parts], dim=-1))
    dense = [nn.Linear(128, n) for n in (64, 32)]
    assert torch.equal(concat_linears(dense)(x), torch.cat([m(x) for m in dense], dim=-1))
    assert concat_linears([parts[0], _quantized_linear(QuantScheme(4, 64), N=32, K=128)]) is None
    assert concat_linears([parts[0], dense[0]]) is None
