"""The int8-activation (A8) matmul of `lmforge.engine.kernels` (`lmf_qmm_s8` / `lmf_qmm_a8`): every
ISA body this CPU has, and the portable one, gives the exact int32 dot products of an integer
reference; the per-token quantizer equals torch's round-and-clamp; `QmmLinear` with int8 activations
stays within a stated tolerance of the exact A16 kernel, in a layer and in a model's greedy tokens;
the engine picks it only when asked and says why it cannot."""

from __future__ import annotations

import contextlib
import itertools
import json

import numpy as np
import pytest
import torch

from a8_codes import nibble_order, pack4
from lmforge.engine import LLM, SamplingParams, kernels
from lmforge.engine.config import EngineConfig
from lmforge.engine.model_runner import ModelRunner
from lmforge.model.reference import save_hf_model
from lmforge.quant import QuantScheme, load_pretrained, quantize_rtn
from lmforge.quant.linear import QmmLinear, QuantizedLinear, select_backend, swap_backend
from lmforge.quant.quantize import QuantizeConfig, quantize_model

LIB = kernels.load()
pytestmark = pytest.mark.skipif(LIB is None, reason=f"no compiled kernels: {kernels.status()}")
CPU = torch.device("cpu")
# A8 against A16 on Gaussian activations: the int8 rounding error (<= absmax / 254 an element, absmax of a block)
# gives 0.6-0.75% relative error on a whole output (measured, K = 256); 2% leaves room for other inputs,
# not for a wrong kernel.
A8_REL_TOL = 0.02


def _a8_block(bits: int, gs: int, K: int) -> int:
    """The activations' block the kernels expect for these weights (common.h's `a8_block`)."""
    gs = K if bits == 8 and gs <= 0 else gs
    return 32 if gs == 16 else gs


def _qmm_s8(isa, q_MK, xs, w, ws_NG, N, bits, gs, threads=2) -> tuple[int, np.ndarray]:
    """xs: the activation scales (M, K / block), or (M,) for one scale a row, repeated over its blocks."""
    M, K = q_MK.shape
    if xs.ndim == 1:
        xs = np.ascontiguousarray(np.repeat(xs[:, None], K // _a8_block(bits, gs, K), 1))
    out = np.full((M, N), np.nan, np.float32)
    rc = LIB.qmm_s8(q_MK.ctypes.data, xs.ctypes.data, w.ctypes.data, ws_NG.ctypes.data, out.ctypes.data,
                    M, N, K, bits, gs, threads, kernels.A8_ISAS[isa], None)
    return rc, out


ISAS = list(kernels.A8_ISAS)
HAS_PANEL = LIB is not None and LIB.a8_panel_rows(-1) > 0  # an AVX-512 VNNI CPU: the A8 panel GEMM (qmm_a8_panel.c)


@contextlib.contextmanager
def panel_from(rows: int):
    """The A8 panel GEMM from `rows` rows (0: never) inside the block, its threshold restored after."""
    before = LIB.a8_panel_rows(rows)
    try:
        yield
    finally:
        LIB.a8_panel_rows(before)


def _panel_modes(isa: str) -> tuple[int, ...]:
    """Thresholds to run an A8 body under: the row body (0), and where it hands calls to the panel GEMM, from 1 row."""
    return (0, 1) if HAS_PANEL and isa.startswith("avx512") else (0,)
SHAPES = [(8, 0, 1024), (8, 0, 96), (8, 0, 160), (4, 32, 1024), (4, 64, 256), (4, 96, 384), (4, 128, 512), (4, 32, 96)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits,gs,K", SHAPES, ids=[f"w{b}-g{g}-K{k}" for b, g, k in SHAPES])
def test_integer_dot_products_are_exact(isa, bits, gs, K):
    """Unit scales: the float32 output is the int32 dot product itself (every partial sum < 2^24 for
    these K), so each body must equal the int64 reference bit for bit: batch 1-17 (full and partial
    blocks of 4 and 8 rows), K with a half 64-code step, int4 groups of 32 to 128, extreme codes; on an
    AVX-512 VNNI CPU the panel GEMM too, from one row (37 weight rows: two full panels and a partial one)."""
    if not LIB.a8_isa_supported(kernels.A8_ISAS[isa]):
        pytest.skip(f"this CPU has no {isa} (runs {LIB.a8_isas()})")  # hardware absent, e.g. AVX-VNNI on Zen 4
    rng = np.random.default_rng(K + bits + gs)
    N = 37
    for M, panel in itertools.product((1, 4, 5, 9, 17), _panel_modes(isa)):
        q = rng.integers(-127, 128, (M, K), dtype=np.int8)
        q[0, :4] = (127, -127, 127, -127)
        if bits == 8:
            c = rng.integers(-128, 128, (N, K), dtype=np.int8)
            c[0, :4] = (-128, -128, 127, 127)  # |c| = 128 with |q| = 127: maddubs pairs at their int16 edge
            w, G, q_in = c, 1, q
        else:
            c = rng.integers(-8, 8, (N, K), dtype=np.int8)
            w, G, q_in = pack4(c), K // gs, nibble_order(q)
        with panel_from(panel):
            rc, out = _qmm_s8(isa, q_in, np.ones(M, np.float32), w, np.ones((N, G), np.float32), N, bits, gs)
        assert rc == 0
        want = q.astype(np.int64) @ c.astype(np.int64).T
        assert np.array_equal(out.astype(np.int64), want), (M, panel, np.abs(out - want).max())


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_every_weight_row_is_computed_once_whatever_the_split(threads):
    """The rows are handed out as one contiguous 7/8 of each thread's share, then small chunks
    (`take_rows`); too few rows for a share: chunks only. Every output row is the exact dot product
    (none left NaN, none from a wrong row) for row counts around each edge."""
    rng = np.random.default_rng(threads)
    K, M = 64, 2
    for N in (1, 7, 8, 9, 17, 37, 64, 100, 301):
        q = rng.integers(-127, 128, (M, K), dtype=np.int8)
        c = rng.integers(-128, 128, (N, K), dtype=np.int8)
        rc, out = _qmm_s8("portable", q, np.ones(M, np.float32), c, np.ones((N, 1), np.float32), N, 8, 0, threads)
        assert rc == 0 and np.array_equal(out.astype(np.int64), q.astype(np.int64) @ c.astype(np.int64).T), N
        x = torch.from_numpy(rng.standard_normal((M, K), dtype=np.float32))
        y = torch.full((M, N), float("nan"))
        w = torch.from_numpy(c.copy())
        assert LIB.qmm_f32(x.data_ptr(), w.data_ptr(), torch.ones(N).data_ptr(), y.data_ptr(), M, N, K, 8, 0,
                           threads, 0, None) == 0
        torch.testing.assert_close(y, x @ w.float().T, rtol=1e-4, atol=1e-3)  # outputs ~100: float32 sums


@pytest.mark.parametrize("isa", ISAS)
def test_scaled_output_agrees_with_portable(isa):
    """Real scales, a weight scale a group and an activation scale a block: every body applies them the same
    way (float32 sums in another order: 1e-6)."""
    if not LIB.a8_isa_supported(kernels.A8_ISAS[isa]):
        pytest.skip(f"this CPU has no {isa}")
    rng = np.random.default_rng(1)
    for bits, gs, K in ((8, 0, 640), (8, 32, 640), (8, 96, 576), (4, 32, 640), (4, 128, 512), (4, 96, 576)):
        N, M = 19, 6
        q = rng.integers(-127, 128, (M, K), dtype=np.int8)
        xs = rng.uniform(0.01, 1, (M, K // _a8_block(bits, gs, K))).astype(np.float32)
        if bits == 8:
            w, G = rng.integers(-128, 128, (N, K), dtype=np.int8), K // (gs or K)
        else:
            w, G = rng.integers(0, 256, (N, K // 2), dtype=np.uint8), K // gs
        ws = rng.uniform(0.001, 0.1, (N, G)).astype(np.float32)
        _, want = _qmm_s8("portable", q, xs, w, ws, N, bits, gs, threads=1)
        for panel in _panel_modes(isa):
            with panel_from(panel):
                rc, got = _qmm_s8(isa, q, xs, w, ws, N, bits, gs, threads=3)
            assert rc == 0
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_refusals():
    q, xs, ws = np.zeros((1, 64), np.int8), np.ones(1, np.float32), np.ones((4, 2), np.float32)
    w = np.zeros((4, 64), np.int8)
    assert _qmm_s8("portable", q[:, :48].copy(), xs, w, ws, 4, 8, 0)[0] == -1  # K not a multiple of 32
    assert _qmm_s8("portable", q, xs, w, ws, 4, 4, 48)[0] == -1  # int4 group not a multiple of 32
    assert _qmm_s8("portable", q, xs, w, ws, 4, 2, 32)[0] == -1  # 2-bit
    missing = [i for i in ISAS if not LIB.a8_isa_supported(kernels.A8_ISAS[i])]
    for isa in missing:  # a body this CPU lacks is refused, never run
        assert _qmm_s8(isa, q, xs, w, ws, 4, 8, 0)[0] == -2
        with pytest.raises(ValueError, match=isa):
            LIB.a8(isa)


def test_isa_choice_and_status(monkeypatch):
    assert LIB.a8_isas()[-1] == "portable" and LIB.a8().isa == LIB.a8_isas()[0]
    monkeypatch.setenv("LMFORGE_A8_ISA", "portable")
    assert LIB.a8().isa == "portable" and "int8-activation matmul: portable" in kernels.status()
    monkeypatch.setenv("LMFORGE_A8_ISA", "sse9")
    with pytest.raises(ValueError, match="LMFORGE_A8_ISA='sse9': not one of portable, avx2"):
        LIB.a8()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nibble", [0, 1])
@pytest.mark.parametrize("block", [0, 32, 96])
def test_quantizer_equals_torch_round_and_clamp(dtype, nibble, block):
    """A scale a block of `block` inputs (0: the row): absmax / 127, codes round-to-even and clamped; an
    outlier sets its own block's scale and leaves the others' codes fine."""
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(3)).to(dtype)
    x[1] = 0  # an all-zero row: scale 0, codes 0
    x[2, 7] = 40.0  # an outlier sets its block's scale
    A = 96 // (block or 96)
    q, s = np.zeros((5, 96), np.int8), np.zeros((5, A), np.float32)
    assert LIB.quantize_s8(x.data_ptr(), int(dtype == torch.float32), 5, 96, nibble, block, q.ctypes.data,
                           s.ctypes.data) == 0
    xb = x.float().reshape(5, A, 96 // A)
    want_s = xb.abs().amax(2) / 127
    want_q = torch.where(want_s[..., None] > 0, torch.round(xb / want_s[..., None]), 0).clamp(-127, 127)
    want = want_q.to(torch.int8).reshape(5, 96).numpy()
    assert torch.equal(torch.from_numpy(s), want_s)
    assert np.array_equal(q, nibble_order(want) if nibble else want)
    if block == 32:  # the outlier's neighbours in other blocks keep their resolution
        assert np.abs(q[2, 32:]).max() >= 100


def test_quantizer_refuses_a_block_that_does_not_divide_the_row():
    x, q, s = torch.zeros(1, 96), np.zeros((1, 96), np.int8), np.zeros(4, np.float32)
    assert LIB.quantize_s8(x.data_ptr(), 1, 1, 96, 0, 64, q.ctypes.data, s.ctypes.data) == -1
    assert LIB.quantize_s8(x.data_ptr(), 1, 1, 96, 0, 48, q.ctypes.data, s.ctypes.data) == -1


def _layer(scheme: QuantScheme, N: int, K: int) -> QuantizedLinear:
    g = torch.Generator().manual_seed(K + scheme.num_bits)
    q = QuantizedLinear(K, N, scheme, bias=True, scale_dtype=torch.float32)
    qw, s = quantize_rtn(torch.randn(N, K, generator=g), scheme, torch.float32)
    q.qweight.copy_(qw)
    q.weight_scale.copy_(s)
    q.bias.data.normal_(generator=g)
    return q


@pytest.mark.parametrize("scheme", [QuantScheme(8, None), QuantScheme(4, 32), QuantScheme(4, 128)],
                         ids=["w8", "w4-g32", "w4-g128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("panel", [False, True], ids=["rows", "panel"])
def test_a8_linear_within_tolerance_of_a16(scheme, dtype, panel):
    """`QmmLinear` with int8 activations against the exact dequantized matmul (A16), batch 1-257. With the
    panel GEMM (an AVX-512 VNNI CPU) every row count stays on int8 activations; without (without
    `prefill_bf16`) prefill chunks up to `A8_PREFILL_ROWS` do, and above that it is the A16 path again
    (dequantize + sgemm)."""
    if panel and not HAS_PANEL:
        pytest.skip(f"no A8 panel GEMM on this CPU (AVX-512 VNNI; runs {LIB.a8_isas()})")
    q = _layer(scheme, N=72, K=256)
    isa = LIB.a8().isa
    a8 = kernels.A8Matmul.bind(LIB.qmm_a8, isa, LIB.a8_panel_rows(-1) if panel else 0)
    layer = QmmLinear(q, dtype, qmm=LIB.qmm_f32, a8=a8)
    assert QmmLinear.supports_a8(q, CPU, dtype) is None and layer.a8_panel == panel
    w = q.dequantized_weight().double()
    assert QmmLinear.A8_PREFILL_ROWS == 256
    int8_rows = 10**9 if panel else 256
    with panel_from(LIB.a8_panel_rows(-1) if panel else 0):
        for M in (1, 3, 16, 64, 65, 256, 257):
            x = torch.randn(M, 256, generator=torch.Generator().manual_seed(M)).to(dtype)
            ref = x.double() @ w.t() + q.bias.double()
            got = layer(x)
            assert got.dtype == dtype and got.shape == (M, 72)
            err = ((got.double() - ref).norm() / ref.norm()).item()
            assert err < (A8_REL_TOL if M <= int8_rows else 1e-2 if dtype == torch.bfloat16 else 1e-6), (M, err)
            assert err > (1e-4 if M <= int8_rows else 0)  # the int8 path did run: its rounding shows


@pytest.mark.parametrize("scheme", [QuantScheme(8, None), QuantScheme(4, 32)], ids=["w8", "w4-g32"])
@pytest.mark.parametrize("panel", [False, True], ids=["rows", "panel"])
def test_a8_swiglu_gives_the_bits_of_the_middle_then_the_layer(scheme, panel):
    """`QmmLinear.forward_swiglu` on int8 activations (`lmf_qmm_a8` act 2: silu(gate) * up taken while quantizing the
    gate_up rows) gives the bits of `lmf_silu_mul_rows_f32` then the layer, 1-200 rows (the row bodies and, on an
    AVX-512 VNNI CPU, the panel GEMM); with a bias it declines (None) and the caller runs the middle itself."""
    if panel and not HAS_PANEL:
        pytest.skip(f"no A8 panel GEMM on this CPU (AVX-512 VNNI; runs {LIB.a8_isas()})")
    g = torch.Generator().manual_seed(5)
    q = QuantizedLinear(256, 72, scheme, bias=False, scale_dtype=torch.float32)
    qw, s = quantize_rtn(torch.randn(72, 256, generator=g), scheme, torch.float32)
    q.qweight.copy_(qw)
    q.weight_scale.copy_(s)
    a8 = kernels.A8Matmul.bind(LIB.qmm_a8, LIB.a8().isa, LIB.a8_panel_rows(-1) if panel else 0)
    layer = QmmLinear(q, torch.float32, qmm=LIB.qmm_f32, a8=a8)
    with panel_from(LIB.a8_panel_rows(-1) if panel else 0):
        for M in (1, 5, 16, 64, 200):
            gu = torch.randn(M, 512, generator=g) * 4
            gu[0, :2] = torch.tensor([95.0, -95.0])
            mid = torch.empty(M, 256)
            LIB.silu_mul_rows_f32(gu.data_ptr(), mid.data_ptr(), M, 256, 2)
            got = layer.forward_swiglu(gu)
            assert got is not None and torch.equal(got, layer(mid)), M
    biased = QmmLinear(_layer(scheme, N=72, K=256), torch.float32, qmm=LIB.qmm_f32, a8=a8)
    assert biased.forward_swiglu(torch.randn(4, 512)) is None


@pytest.mark.parametrize("scheme", [QuantScheme(8, None), QuantScheme(4, 32)], ids=["w8", "w4-g32"])
def test_a8_prefill_bf16_gemm_above_its_rows(scheme):
    """With `prefill_bf16` (the engine sets it on CPUs with bf16 units) rows above `A8_BF16_PREFILL_ROWS` run
    oneDNN's bf16 GEMM on the dequantized weight: bf16 rounding of weights and activations, float32
    accumulation; that many rows and fewer still take the int8-activation kernel (the same numbers as
    without the flag)."""
    q = _layer(scheme, N=72, K=256)
    rows_only = kernels.A8Matmul.bind(LIB.qmm_a8, LIB.a8().isa, 0)  # as on a CPU without the panel GEMM
    fast = QmmLinear(q, torch.float32, qmm=LIB.qmm_f32, a8=rows_only, prefill_bf16=True)
    plain = QmmLinear(q, torch.float32, qmm=LIB.qmm_f32, a8=rows_only)
    w = q.dequantized_weight().double()
    rows = QmmLinear.A8_BF16_PREFILL_ROWS
    assert QmmLinear.A8_MAX_ROWS < rows < QmmLinear.A8_PREFILL_ROWS
    for M in (64, rows, rows + 1, 300):
        x = torch.randn(M, 256, generator=torch.Generator().manual_seed(M))
        ref = x.double() @ w.t() + q.bias.double()
        got = fast(x)
        err = ((got.double() - ref).norm() / ref.norm()).item()
        if M <= rows:
            assert torch.equal(got, plain(x))
        else:
            # bf16's rounding shows, within bf16's precision
            assert not torch.equal(got, plain(x)) and 1e-4 < err < 1e-2, (M, err)
    backend = select_backend(torch.nn.Sequential(q), CPU, qmm=LIB.qmm_f32, quant_activations="int8", a8=rows_only,
                             prefill_bf16=True)
    assert "bf16 GEMM" in backend.name and backend(q, torch.float32).prefill_bf16
    if HAS_PANEL:  # the panel GEMM takes every row count: no bf16 GEMM, whatever the flag
        backend = select_backend(torch.nn.Sequential(q), CPU, qmm=LIB.qmm_f32, quant_activations="int8",
                                 a8=LIB.a8(), prefill_bf16=True)
        assert "panel GEMM" in backend.name and not backend(q, torch.float32).prefill_bf16


def test_select_backend_int8_and_its_refusals():
    q = _layer(QuantScheme(8, None), 32, 64)
    model = torch.nn.Sequential(q)
    backend = select_backend(model, CPU, qmm=LIB.qmm_f32, quant_activations="int8", a8=LIB.a8())
    assert "lmf_qmm_a8" in backend.name and LIB.a8().isa in backend.name
    assert select_backend(model, CPU, qmm=LIB.qmm_f32).name == QmmLinear.name  # default: the exact A16 kernel
    with pytest.raises(ValueError, match="needs lmforge's compiled CPU kernels"):
        select_backend(model, CPU, quant_activations="int8", a8=None)
    with pytest.raises(ValueError, match="no reference path"):
        select_backend(model, CPU, reference=True, quant_activations="int8", a8=LIB.a8())
    with pytest.raises(ValueError, match="must be one of none, int8"):
        select_backend(model, CPU, quant_activations="fp8")
    with pytest.raises(ValueError, match="no quantized linear layer"):
        select_backend(torch.nn.Sequential(torch.nn.Linear(4, 4)), CPU, quant_activations="int8", a8=LIB.a8())
    odd = torch.nn.Sequential(_layer(QuantScheme(4, 16), 8, 64))
    with pytest.raises(ValueError, match="group 16.*quant_activations='none'"):
        select_backend(odd, CPU, quant_activations="int8", a8=LIB.a8())
    with pytest.raises(ValueError, match="EngineConfig.quant_activations='int4'"):
        EngineConfig(model="m", quant_activations="int4")


@pytest.fixture(scope="module")
def w8_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("a8")
    src = save_hf_model("llama", root / "src", seed=5, hidden_size=128)
    quantize_model(QuantizeConfig(model=str(src), out=str(root / "w8"), scheme="w8a16", group_size=128))
    return root / "w8"


def _greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def test_a8_model_greedy_agrees_with_a16(w8_model):
    """A tiny w8 Llama: A8 logits within tolerance of the A16 kernel's, and greedy tokens mostly agree
    (int8 activations are an approximation: llama.cpp's Q8_0 activations are the precedent)."""
    a16 = load_pretrained(w8_model, dtype="float32", device="cpu")
    a8 = load_pretrained(w8_model, dtype="float32", device="cpu")
    swap_backend(a16, select_backend(a16, CPU, qmm=LIB.qmm_f32), torch.float32)
    swap_backend(a8, select_backend(a8, CPU, qmm=LIB.qmm_f32, quant_activations="int8", a8=LIB.a8()), torch.float32)
    ids = torch.tensor([[1, 5, 9, 33, 100, 7, 8, 9, 42, 17]])
    with torch.inference_mode():
        ref, got = a16(ids), a8(ids)
    assert ((got - ref).norm() / ref.norm()).item() < A8_REL_TOL
    tokens_a16, tokens_a8 = _greedy(a16, [3, 4, 5], 12), _greedy(a8, [3, 4, 5], 12)
    assert sum(a == b for a, b in zip(tokens_a16, tokens_a8)) >= 9, (tokens_a16, tokens_a8)


@pytest.mark.parametrize("bf16_units", ["0", "1"])
def test_model_runner_takes_the_choice(w8_model, bf16_units, monkeypatch):
    monkeypatch.setenv("LMFORGE_CPU_BF16", bf16_units)  # both branches on any CPU (the flag reading overridden)
    model = load_pretrained(w8_model, dtype="float32", device="cpu")
    runner = ModelRunner(model, num_blocks=8, block_size=16, quant_activations="int8")
    assert "lmf_qmm_a8" in runner.linear_backend and runner.quantized_linears == 14
    # A8 prefill rows: on an AVX-512 VNNI CPU the A8 panel GEMM at every row count; else above A8_MAX_ROWS a bf16
    # GEMM where the CPU has bf16 units, else the float32 panel GEMM (where this build has it), else dequantize + sgemm
    gemm = kernels.load().gemm_ok
    assert ("AVX-512 VNNI panel GEMM" in runner.linear_backend) is HAS_PANEL
    assert ("lmf_gemm_f32" in runner.linear_backend) is (gemm and bf16_units == "0" and not HAS_PANEL)
    assert ("bf16 GEMM" in runner.linear_backend) is (bf16_units == "1" and not HAS_PANEL)
    plain = ModelRunner(load_pretrained(w8_model, dtype="float32", device="cpu"), num_blocks=8, block_size=16)
    assert plain.linear_backend == QmmLinear.name + ("; prefill on lmforge lmf_gemm_f32" if gemm else "")


def test_engine_runs_int8_activations_when_asked(w8_model):
    """`LLM(quant_activations="int8")` end to end: the stats name the A8 kernel and its body, and the
    greedy tokens mostly agree with the default exact (A16) engine's."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[1, 5, 9, 33, 100, 7], [3, 4, 5]]
    runs = {}
    for qa in ("none", "int8"):
        llm = LLM(str(w8_model), dtype="float32", device="cpu", quant_activations=qa)
        runs[qa] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert ("lmf_qmm_a8" in llm.stats()["linear_backend"]) == (qa == "int8")
    same = sum(a == b for g, w in zip(runs["int8"], runs["none"]) for a, b in zip(g, w)) / 24
    assert same >= 0.75, runs


@pytest.mark.parametrize("flags", [("-march=x86-64",), ("-DLMF_PORTABLE",)], ids=["baseline-x86-64", "portable"])
def test_bodies_are_chosen_at_run_time_not_compile_time(flags, tmp_path):
    """Built for baseline x86-64 (no AVX in the compiler's target), the library still has every body
    this CPU runs (each is compiled for its own ISA and picked from the CPU's flags); built portable,
    only the portable body; either gives the exact dot products."""
    if flags[0].startswith("-march") and "avx2" not in LIB.a8_isas():
        pytest.skip("not an x86-64 CPU with AVX2")
    lib = kernels._bind(kernels.build(flags, out_dir=tmp_path))
    assert lib.a8_isas() == (["portable"] if flags == ("-DLMF_PORTABLE",) else LIB.a8_isas())
    rng = np.random.default_rng(7)
    q, c = rng.integers(-127, 128, (3, 256), dtype=np.int8), rng.integers(-8, 8, (5, 256), dtype=np.int8)
    want = q.astype(np.int64) @ c.astype(np.int64).T
    for isa in lib.a8_isas():
        out = np.zeros((3, 5), np.float32)
        assert lib.qmm_s8(nibble_order(q).ctypes.data, np.ones((3, 8), np.float32).ctypes.data, pack4(c).ctypes.data,
                          np.ones((5, 8), np.float32).ctypes.data, out.ctypes.data, 3, 5, 256, 4, 32, 1,
                          kernels.A8_ISAS[isa], None) == 0
        assert np.array_equal(out.astype(np.int64), want), isa


def test_bench_linear_reports_every_kernel(tmp_path, monkeypatch):
    """`lmforge bench linear`'s quantized section: a row per weight kind, kernel and batch, with GB/s,
    GFLOP/s and the share of the roofline; JSON and Markdown written. (Small shapes; the roofline
    stubbed: the doctor's STREAM measurement is tested with the doctor.)"""
    from typer.testing import CliRunner  # noqa: PLC0415 - the CLI and bench sit above the engine: this test only

    from lmforge.bench import linear as bench  # noqa: PLC0415
    from lmforge.cli import app as cli_app  # noqa: PLC0415

    monkeypatch.setattr(bench, "QUANT_SHAPES", ((256, 96),))
    monkeypatch.setattr(bench, "roofline", lambda: {"triad_gbs": 20.0, "source": "test"})
    result = CliRunner().invoke(cli_app, ["bench", "linear", "--no-packed", "--batches", "1,3", "--threads", "1",
                                          "--working-set-mb", "1", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "bench_linear.json").read_text())["quant"]["rows"]
    kinds = {r["kernel"] for r in rows}
    assert kinds >= {f"A8 {isa}" for isa in LIB.a8_isas()} | {"A16 exact (lmf_qmm_f32 rows)", "torch (bf16 activations)"}
    assert ("A16 exact (lmf_gemm_f32 panel)" in kinds) == LIB.gemm_ok
    assert ("A8 panel GEMM (avx512_vnni)" in kinds) == HAS_PANEL
    assert {(r["weights"], r["batch"]) for r in rows} == {(w, b) for w in ("w8a16", "w4a16 g128", "bf16")
                                                          for b in (1, 3)}
    bf16 = {r["kernel"] for r in rows if r["weights"] == "bf16"}  # bf16 weights: rows, oneDNN, the panel where it runs
    panel = LIB.bf16_panel_rows(-1) > 0
    assert bf16 == {"A16 exact (lmf_qmm_f32 rows, bits 16)", "oneDNN bf16 (F.linear)"} | (
        {"bf16 panel GEMM (avx512_bf16)"} if panel else set())
    for r in rows:
        assert r["us"] > 0 and r["median_us"] >= r["us"] and r["weight_gbs"] > 0 and r["gflops"] > 0
        assert abs(r["of_triad"] - r["weight_gbs"] / 20.0) < 1e-3
    md = (tmp_path / "bench_linear.md").read_text()
    assert "STREAM triad 20.0 GB/s" in md and "A8 " + LIB.a8_isas()[0] in md
    assert "`PackedLinear`" not in md  # --no-packed


def test_bench_linear_packed_section_covers_float32(tmp_path, monkeypatch):
    """The packed section times float32 everywhere oneDNN runs (the engine packs float32 linears) and bf16 where
    the CPU has bf16 units, with the outputs compared; small shapes."""
    from lmforge.bench import linear as bench  # noqa: PLC0415 - the bench sits above the engine: this test only
    from lmforge.engine.model_runner import can_pack_linear  # noqa: PLC0415

    monkeypatch.setattr(bench, "SHAPES", ((64, 96),))
    monkeypatch.setattr(bench, "ROWS", (1, 3))
    report = bench.run(tmp_path, quant=False)
    rows, skipped = report["packed"]["rows"], report["packed"]["skipped"]
    bf16 = can_pack_linear(torch.device("cpu"), torch.bfloat16)
    assert {(r["dtype"], r["rows"]) for r in rows} == {(d, m) for d in ("float32",) + (("bf16",) if bf16 else ())
                                                       for m in (1, 3)}
    assert all(r["same"] and r["plain_us"] > 0 and r["packed_us"] > 0 for r in rows)
    assert ("bf16" in skipped) is not bf16
    md = (tmp_path / "bench_linear.md").read_text()
    assert "| float32 | 64 → 96 | 3 |" in md


def test_avx512_vnni_cpu_runs_the_256_bit_body_by_default(monkeypatch):
    """On an AVX-512 VNNI CPU the default body is the 256-bit one on the EVEX vpdpbusd (A8_YMM_BODY, the
    avx_vnni body's code with the other encoding, so its exactness tests above cover that code too); the
    512-bit body stays a choice."""
    if "avx512_vnni" not in LIB.a8_isas():
        pytest.skip(f"no AVX-512 VNNI on this CPU (runs {LIB.a8_isas()})")
    monkeypatch.delenv("LMFORGE_A8_ISA", raising=False)
    assert LIB.a8_isas()[:2] == ["avx512_vnni_256", "avx512_vnni"] and LIB.a8().isa == "avx512_vnni_256"
    monkeypatch.setenv("LMFORGE_A8_ISA", "avx512_vnni")
    assert LIB.a8().isa == "avx512_vnni"
