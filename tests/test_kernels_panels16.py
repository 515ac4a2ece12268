"""int4 weights stored as 16-row panels (common.h's LMF_PANELS16; `QmmLinear.store_panels`): on an AVX-512 VNNI
CPU the lanes body (few rows) and the panel GEMM (many) read them and give the exact integer dot products; a layer
gives the panel GEMM's bits at every row count, and the rows layout's values to float32 rounding; the layout reads
back to the same weight; the engine stores its layers so (not the LM head) and its greedy tokens do not move;
every other body refuses the layout instead of misreading it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from a8_codes import nibble_order
from lmforge.engine import LLM, SamplingParams, kernels
from lmforge.model.reference import save_hf_model
from lmforge.quant import QuantScheme
from lmforge.quant.linear import QmmLinear, QuantizedLinear
from lmforge.quant.quantize import QuantizeConfig, quantize_model

LIB = kernels.load()
HAS_PANELS = LIB is not None and LIB.a8_panel_rows(-1) > 0  # an AVX-512 VNNI CPU (qmm_a8_panel.c)
pytestmark = pytest.mark.skipif(LIB is None, reason=f"no compiled kernels: {kernels.status()}")
needs_panels = pytest.mark.skipif(not HAS_PANELS, reason="stored panels are read by the AVX-512 VNNI bodies only; "
                                                         "this CPU runs " + ", ".join(LIB.a8_isas() if LIB else []))


def _layer(N: int, K: int, gs: int, scales: torch.Tensor, codes: torch.Tensor, isa: str | None = None,
           zeros: torch.Tensor | None = None, bits: int = 4) -> QmmLinear:
    """codes: signed (N, K) in [-8, 8) (int8: [-128, 128)), or with `zeros` (a GGUF Q4_1's form: w = scale * nibble +
    zero) the nibbles in [0, 16)."""
    q = QuantizedLinear(K, N, QuantScheme(bits, gs, zero_point=zeros is not None))
    q.qweight.copy_(codes)
    q.weight_scale = scales
    if zeros is not None:
        q.weight_zero = zeros
    return QmmLinear(q, torch.float32, a8=LIB.a8(isa))


def _raw(layer: QmmLinear, q_MK: np.ndarray, M: int, threads: int = 2) -> tuple[int, np.ndarray]:
    """`lmf_qmm_s8` on signed activations q (int4: in the bodies' nibble order), activation scales 1."""
    K, N = layer.K, layer.N
    q = torch.from_numpy(np.ascontiguousarray(q_MK))
    xs = torch.ones(M, K // layer.gs)
    out = torch.full((M, N), float("nan"))
    rc = LIB.qmm_s8(q.data_ptr(), xs.data_ptr(), layer.codes.data_ptr(), layer.scale.data_ptr(), out.data_ptr(), M,
                    N, K, layer.bits, layer.gs, threads, kernels.A8_ISAS[layer.a8.isa], layer.desc_ptr)
    return rc, out.numpy()


@needs_panels
@pytest.mark.parametrize("bits,N,K,gs", [(4, 48, 96, 32), (4, 32, 1024, 32), (4, 80, 256, 128), (4, 16, 64, 64),
                                         (8, 48, 96, 32), (8, 32, 1024, 1024), (8, 16, 160, 32)])
@pytest.mark.parametrize("half", [True, False], ids=["f16-scales", "f32-scales"])
def test_stored_panels_give_exact_integer_dot_products(bits, N, K, gs, half):
    """Unit scales: the output is the int32 dot product itself, for 1-5 rows (the lanes body: one or two panels side
    by side, full and partial passes of 4 rows) and 63-65 rows (the panel GEMM from 64 on stored panels), extreme
    codes and activations (int4: the high nibbles' 16x products, -8 * sum(q) at a group's start; int8: codes -128 and
    127, an odd count of words a group)."""
    rng = np.random.default_rng(N + K + gs + bits)
    lo, hi = (-8, 8) if bits == 4 else (-128, 128)
    c = rng.integers(lo, hi, (N, K), dtype=np.int8)
    c[0, :4], c[1, :4] = (hi - 1,) * 4, (lo,) * 4
    ones = torch.ones(N, K // gs, dtype=torch.float16 if half else torch.float32)
    layer = _layer(N, K, gs, ones, torch.from_numpy(c), bits=bits)
    assert layer.store_panels(int8=True) and layer.layout == 16
    for M in (1, 2, 3, 4, 5, 63, 64, 65):
        q = rng.integers(-127, 128, (M, K), dtype=np.int8)
        q[0, :4] = (127, -127, 127, -127)
        rc, out = _raw(layer, nibble_order(q) if bits == 4 else q, M)
        assert rc == 0
        want = q.astype(np.int64) @ c.astype(np.int64).T
        assert np.array_equal(out.astype(np.int64), want), (M, np.abs(out - want).max())


@needs_panels
@pytest.mark.parametrize("half", [True, False], ids=["f16-scales", "f32-scales"])
@pytest.mark.parametrize("form", ["int4", "int4-zeros", "int8", "int8-per-channel"])
def test_a_stored_panel_layer_gives_the_panel_gemm_bits_and_the_rows_values(half, form):
    """Real scales (and zero offsets, as a Q4_1 file's) and activations: at every row count the stored layer equals
    the rows layout on the panel GEMM bit for bit (the same terms in the same order), and the rows layout's row
    bodies to float32 rounding."""
    torch.manual_seed(0)
    N, K = 96, 640
    bits, with_zeros, gs = (8 if form.startswith("int8") else 4), form == "int4-zeros", K if "channel" in form else 32
    lo, hi = (0, 16) if with_zeros else (-8, 8) if bits == 4 else (-128, 128)
    codes = torch.randint(lo, hi, (N, K), dtype=torch.int8)
    s = torch.rand(N, K // gs) * 0.02 + 0.001
    z = -8.5 * s * (1 + 0.1 * torch.rand(N, K // gs)) if with_zeros else None
    s, z = (s.half(), None if z is None else z.half()) if half else (s, z)
    rows, panels = (_layer(N, K, gs, s, codes, zeros=z, bits=bits) for _ in range(2))
    assert panels.store_panels(int8=True)
    assert torch.equal(panels.dequantized().clone(), rows.dequantized().clone())
    before, lanes = LIB.a8_panel_rows(1), LIB.a8_lanes_rows(-1)
    try:
        for M in (1, 3, 5, 8, 17):  # the lanes body against the panel GEMM on rows
            x = torch.randn(M, K)
            assert torch.equal(panels(x), rows(x)), M
        LIB.a8_lanes_rows(0)  # and the panel GEMM on stored panels
        for M in (1, 3, 8):
            x = torch.randn(M, K)
            assert torch.equal(panels(x), rows(x)), M
    finally:
        LIB.a8_panel_rows(before)
        LIB.a8_lanes_rows(lanes)
    for M in (1, 2, 4, 5):
        x = torch.randn(M, K)
        torch.testing.assert_close(panels(x), rows(x), rtol=1e-5, atol=1e-5)


def test_the_stored_layout_reads_back_to_the_same_weight():
    """`dequantized` (every non-A8 path's weight) is the same float32 weight in either layout; scales and codes are
    the same bytes, moved."""
    if not HAS_PANELS:  # store_panels declines: nothing moves, and says so
        layer = _layer(32, 64, 32, torch.ones(32, 2), torch.zeros(32, 64, dtype=torch.int8))
        assert not layer.store_panels() and layer.layout == 0
        return
    torch.manual_seed(1)
    N, K = 64, 256
    codes = torch.randint(-8, 8, (N, K), dtype=torch.int8)
    s = (torch.rand(N, K // 32) + 0.5).half()
    a, b = _layer(N, K, 32, s, codes), _layer(N, K, 32, s, codes)
    assert b.store_panels()
    assert not torch.equal(a.codes, b.codes)  # moved
    assert torch.equal(a.codes.flatten().sort().values, b.codes.flatten().sort().values)
    assert torch.equal(a.dequantized().clone(), b.dequantized().clone())
    assert not b.store_panels()  # once


def test_layers_the_panels_do_not_take_keep_their_rows():
    """int8 codes with zeros, zeros in another dtype than the scales, N not a multiple of 16: store_panels declines."""
    torch.manual_seed(2)
    cases = [(QuantScheme(8, 32, zero_point=True), 32), (QuantScheme(4, 32, zero_point=True), 32),
             (QuantScheme(4, 32), 24), (QuantScheme(8, 32), 24)]
    for scheme, N in cases:
        q = QuantizedLinear(64, N, scheme)
        q.weight_scale = torch.ones(N, 2)
        if scheme.zero_point:
            q.weight_zero = torch.zeros(N, 2, dtype=torch.float16)
        layer = QmmLinear(q, torch.float32, a8=LIB.a8())
        assert not layer.store_panels() and layer.layout == 0, (scheme, N)


@needs_panels
def test_other_bodies_refuse_stored_panels():
    """A body that reads rows would misread panels: `lmf_qmm_s8` refuses them (-2) instead."""
    layer = _layer(32, 64, 32, torch.ones(32, 2), torch.zeros(32, 64, dtype=torch.int8), isa="portable")
    layer.a8_panel = True  # as on this CPU's default body, so that it stores them
    assert layer.store_panels()
    rc, _ = _raw(layer, np.zeros((1, 64), np.int8), 1)
    assert rc == -2


@needs_panels
@pytest.mark.parametrize("scheme,panels", [("w4a16", "1"), ("w8a16", None)])
def test_the_engine_stores_its_layers_as_panels_and_its_tokens_do_not_move(tmp_path, scheme, panels):
    """An int4 g32 (`LMFORGE_A8_PANELS=1`) / int8 per-channel model (the default, `all`) with int8 activations: every
    layer linear stored as panels, named in the backend's line; greedy tokens equal to the rows layout's (LMFORGE_A8_PANELS=0) for one and for several
    sequences."""
    src = save_hf_model("llama", tmp_path / "src", seed=3, hidden_size=128)
    path = tmp_path / "w4"
    quantize_model(QuantizeConfig(model=str(src), out=str(path), scheme=scheme, group_size=32))
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [11, 12, 13, 14, 15, 16, 17]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = {}
    for which in (panels, "0"):
        with pytest.MonkeyPatch.context() as mp:
            if which is None:
                mp.delenv("LMFORGE_A8_PANELS", raising=False)
            else:
                mp.setenv("LMFORGE_A8_PANELS", which)
            llm = LLM(str(path), quant_activations="int8", enable_prefix_caching=False)
            runner = llm.llm_engine.model_runner
            if which != "0":
                layers = runner.model.config.num_hidden_layers
                assert runner.panel_linears == 4 * layers  # qkv, o, gate_up, down (fused)
                assert "linears stored as 16-row panels" in runner.linear_backend
                assert getattr(runner.model.lm_head, "layout", 0) == 0
            else:
                assert runner.panel_linears == 0
            got[which] = ([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)],
                           llm.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0].token_ids)
    assert got[panels] == got["0"]


def test_int8_panels_follow_the_setting_which_is_checked(tmp_path, monkeypatch):
    """A layer stores int8 codes only when asked (`int8`); the engine asks by default and not under
    `LMFORGE_A8_PANELS=1` (int4 only); a wrong setting is an error that names the values it takes."""
    layer = _layer(32, 64, 32, torch.ones(32, 2), torch.zeros(32, 64, dtype=torch.int8), bits=8)
    assert not layer.store_panels() and layer.layout == 0
    from lmforge.quant.linear import store_layer_panels
    monkeypatch.setenv("LMFORGE_A8_PANELS", "yes")
    with pytest.raises(ValueError, match="all \\(int4 and int8 weights, the default\\), 1"):
        store_layer_panels(torch.nn.Module())


@needs_panels
def test_two_level_scales_as_panels_give_the_panel_gemm_bits():
    """A GGUF Q4_K's form (nibbles; int8 scales and minimums under a float16 a super-block of 8 groups): stored as
    panels it reads back to the same weight and gives the rows layout's panel GEMM bits at every row count."""
    torch.manual_seed(3)
    N, K, per = 48, 512, 8
    G = K // 32
    q = QuantizedLinear(K, N, QuantScheme(4, 32, zero_point=True), scale_per=per)
    q.qweight.copy_(torch.randint(0, 16, (N, K), dtype=torch.int8))
    q.weight_scale.copy_(torch.randint(0, 64, (N, G), dtype=torch.int8))
    q.weight_zero.copy_(-torch.randint(0, 64, (N, G), dtype=torch.int8))
    q.weight_scale_super.copy_((torch.rand(N, G // per) * 0.01 + 0.001).half())
    q.weight_zero_super.copy_((torch.rand(N, G // per) * 0.01).half())
    rows, panels = QmmLinear(q, torch.float32, a8=LIB.a8()), QmmLinear(q, torch.float32, a8=LIB.a8())
    assert panels.store_panels() and panels.desc[0] == 2 and panels.desc[1] == per
    assert torch.equal(panels.dequantized().clone(), rows.dequantized().clone())
    before = LIB.a8_panel_rows(1)
    try:
        for M in (1, 4, 5, 9, 70):
            x = torch.randn(M, K)
            assert torch.equal(panels(x), rows(x)), M
    finally:
        LIB.a8_panel_rows(before)
