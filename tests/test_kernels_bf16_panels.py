"""bf16 weights stored as 16-row panels of input pairs (common.h's LMF_PANELS16; `QmmLinear.store_panels` on a
`from_bf16` layer): on a CPU with AVX512-BF16 the panel GEMM reads them without building its panels (the same bits as
building them), fewer rows take the float32 lanes body (the float64 product to float32 rounding), the layout reads back
to the same weight, the engine stores its bf16 layers so and its greedy tokens do not move, and every body that reads
rows refuses the layout instead of misreading it."""

from __future__ import annotations

import pytest
import torch

from lmforge.engine import LLM, SamplingParams, kernels
from lmforge.model.reference import save_hf_model
from lmforge.quant.linear import QmmLinear, store_layer_panels

LIB = kernels.load()
PANEL_ROWS = LIB.bf16_panel_rows(-1) if LIB is not None and LIB.bf16_panel_rows is not None else 0
pytestmark = pytest.mark.skipif(PANEL_ROWS <= 0, reason="bf16 panels are read by the AVX512-BF16 bodies only: "
                                                        f"{kernels.status()}")


def _layer(N: int, K: int, seed: int) -> tuple[QmmLinear, torch.Tensor]:
    lin = torch.nn.Linear(K, N, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=torch.Generator().manual_seed(seed)))
    lin = lin.to(torch.bfloat16)
    layer = QmmLinear.from_bf16(lin, LIB.qmm_f32, c_gemm=True, bf16_units=True, bf16_panel=(LIB.gemm_bf16, PANEL_ROWS))
    return layer, lin.weight.detach().double()


@pytest.mark.parametrize("N,K", [(16, 32), (48, 64), (80, 1024), (32, 96), (112, 256)])
def test_stored_bf16_panels_give_the_float64_product_and_the_panel_gemm_bits(N, K):
    """Below the panel GEMM's threshold (the lanes body: one or two panels side by side, passes of 4 rows) the float64
    product of the float32 activations to float32 rounding; from it the bits of the panel GEMM building its panels
    from rows (bf16-rounded activations), every remainder of its 12-row passes, 1-3 threads."""
    rows_layer, w = _layer(N, K, N + K)
    stored, _ = _layer(N, K, N + K)
    assert stored.store_panels() and stored.layout == 16 and stored.desc is not None
    g = torch.Generator().manual_seed(K)
    for M in (1, 2, 3, 4, 5, 12, 13, 25):
        x = torch.randn(M, K, generator=g) * 3
        for threads in (1, 2, 3):
            stored.threads = rows_layer.threads = threads
            got = stored(x)
            if M < PANEL_ROWS:
                want = x.double() @ w.T
                err = (got.double() - want).abs().max().item()
                assert err <= 2e-6 * max(want.abs().max().item(), 1.0), (M, threads, err)
            else:
                assert torch.equal(got, rows_layer(x)), (M, threads)


def test_the_stored_bf16_layout_reads_back_and_odd_shapes_keep_their_rows():
    """`dequantized` reads the panels back to the weight; a layer whose rows are not a multiple of 16, or whose many
    rows do not run the bf16 panel GEMM, keeps its rows (False, nothing moved)."""
    layer, w = _layer(48, 64, 1)
    assert layer.store_panels()
    assert torch.equal(layer.dequantized(), w.float())
    assert not layer.store_panels()  # already stored
    odd, _ = _layer(40, 64, 2)
    assert not odd.store_panels() and odd.layout == 0
    lin = torch.nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    plain = QmmLinear.from_bf16(lin, LIB.qmm_f32)  # no bf16 units: the row kernel at every row count
    assert not plain.store_panels() and plain.layout == 0


def test_bodies_that_read_rows_refuse_stored_bf16_panels():
    """The panel GEMM refuses a stored layout whose rows are not whole panels and a layout it does not know; the row
    kernel takes panels for bf16 weights only; the float32 panel GEMM takes none."""
    layer, _ = _layer(32, 64, 3)
    assert layer.store_panels()
    x, out = torch.randn(2, 64), torch.empty(2, 32)
    args = (x.data_ptr(), layer.codes.data_ptr(), layer.scale.data_ptr(), out.data_ptr(), 2)
    assert LIB.gemm_bf16(*args, 32, 64, 1, 16) == 0
    assert LIB.gemm_bf16(*args, 24, 64, 1, 16) == -1  # N % 16
    assert LIB.gemm_bf16(*args, 32, 64, 1, 7) == -1  # no such layout
    assert LIB.qmm_f32(*args, 32, 64, 16, 0, 1, 0, layer.desc_ptr) == 0
    assert LIB.qmm_f32(*args, 32, 64, 8, 0, 1, 0, layer.desc_ptr) == -1  # int8 codes are not read from bf16 panels
    assert LIB.gemm_f32(*args, 32, 64, 16, 0, 1, layer.desc_ptr) == -1


@pytest.mark.parametrize("stored", [True, False], ids=["panels", "rows"])
def test_swiglu_in_the_panel_gemm_gives_the_bits_of_the_middle_then_the_layer(stored):
    """`QmmLinear.forward_swiglu` (`lmf_gemm_bf16_swiglu`: silu(gate) * up computed in the panel GEMM's activation
    pass) gives the bits of `lmf_silu_mul_rows_f32` then the layer, for row counts across the passes and slices
    (a large gate saturating silu included); below the panel GEMM's threshold, on a non-float32 input or without the
    entry it declines (None), and the caller runs the middle itself."""
    N, K = 80, 96
    layer, _ = _layer(N, K, 7)
    if stored:
        assert layer.store_panels()
    g = torch.Generator().manual_seed(3)
    for M in (PANEL_ROWS, 13, 16, 200, 517):
        gu = torch.randn(M, 2 * K, generator=g) * 4
        gu[0, :3] = torch.tensor([95.0, -95.0, 0.0])
        mid = torch.empty(M, K)
        LIB.silu_mul_rows_f32(gu.data_ptr(), mid.data_ptr(), M, K, 2)
        fused = layer.forward_swiglu(gu, LIB.gemm_bf16_swiglu)
        assert fused is not None and torch.equal(fused, layer(mid)), M
    assert layer.forward_swiglu(torch.randn(PANEL_ROWS - 1, 2 * K), LIB.gemm_bf16_swiglu) is None
    assert layer.forward_swiglu(torch.randn(8, 2 * K).bfloat16(), LIB.gemm_bf16_swiglu) is None
    assert layer.forward_swiglu(torch.randn(8, 2 * K), None) is None


def test_the_engine_stores_its_bf16_layers_as_panels_and_its_tokens_do_not_move(tmp_path, monkeypatch):
    """A bf16 checkpoint under `--dtype auto` on a CPU with AVX512-BF16: every layer linear and the untied LM head
    stored as panels (`LMFORGE_BF16_PANELS`, default 1), named in the backend's line; greedy tokens equal to the rows
    layout's (`LMFORGE_BF16_PANELS=0`) for one sequence (the lanes body) and for several (the panel GEMM); a wrong
    setting is an error that names the values it takes."""
    src = save_hf_model("llama", tmp_path / "bf16", seed=5, hidden_size=128, dtype=torch.bfloat16,
                        tie_word_embeddings=False)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [11, 12, 13, 14, 15, 16, 17], [4, 4], [21, 22, 23]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = {}
    monkeypatch.setenv("LMFORGE_CPU_BF16", "1")
    for which in ("1", "0"):
        monkeypatch.setenv("LMFORGE_BF16_PANELS", which)
        llm = LLM(str(src), enable_prefix_caching=False)
        runner = llm.llm_engine.model_runner
        layers = runner.model.config.num_hidden_layers
        if which == "1":
            assert runner.panel_linears == 4 * layers + 1  # qkv, o, gate_up, down (fused), and the LM head
            assert "bf16 linears stored as 16-row panels" in runner.linear_backend
            assert runner.model.lm_head.layout == 16
        else:
            assert runner.panel_linears == 0 and "stored" not in runner.linear_backend
        got[which] = ([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)],
                      llm.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0].token_ids)
    assert got["1"] == got["0"]
    monkeypatch.setenv("LMFORGE_BF16_PANELS", "yes")
    with pytest.raises(ValueError, match="LMFORGE_BF16_PANELS='yes': 1"):
        store_layer_panels(torch.nn.Module())
