"""`--dtype auto` on CPU (`lmforge.engine.kernels.auto_dtype`): bf16 compute only where the CPU has bf16
units, int weights with float32 activations on lmforge's integer kernels, a float32 checkpoint never
rounded; the choice and the kernels in the engine's stats, its ready log line and `/metrics`."""

from __future__ import annotations

import logging

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from lmforge.engine import LLM, SamplingParams, kernels
from lmforge.model.reference import save_hf_model
from lmforge.quant.quantize import QuantizeConfig, quantize_model
from lmforge.serve.metrics import EngineCollector


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("dtype_auto")
    f32 = save_hf_model("llama", root / "f32", seed=1, hidden_size=64, vocab_size=128)
    bf16 = save_hf_model("llama", root / "bf16", seed=1, hidden_size=64, vocab_size=128, dtype=torch.bfloat16)
    quantize_model(QuantizeConfig(model=str(bf16), out=str(root / "w8"), scheme="w8a16"))
    return {"float32": f32, "bfloat16": bf16, "w8": root / "w8"}


@pytest.mark.parametrize("flags,bf16", [("flags : fpu avx2 avx512f avx512_vnni", False),
                                        ("flags : fpu avx2 avx512f avx512_bf16", True),
                                        ("flags : fpu amx_bf16 amx_tile", True), ("Features : fp asimd", False)])
def test_bf16_units_from_cpu_flags(monkeypatch, flags, bf16):
    monkeypatch.delenv("LMFORGE_CPU_BF16", raising=False)
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: flags)
    assert kernels.cpu_has_bf16() is bf16
    monkeypatch.setenv("LMFORGE_CPU_BF16", "0" if bf16 else "1")  # the override wins
    assert kernels.cpu_has_bf16() is not bf16


@pytest.mark.parametrize("has_bf16", ["0", "1"])
def test_policy(monkeypatch, has_bf16):
    monkeypatch.setenv("LMFORGE_CPU_BF16", has_bf16)
    assert kernels.auto_dtype("float32", False)[0] == "float32"  # never rounds a float32 checkpoint
    assert kernels.auto_dtype(None, False)[0] == "float32"
    assert kernels.auto_dtype("bfloat16", True)[0] == "float32"  # int weights: float32 on the integer kernels
    assert kernels.auto_dtype("bfloat16", True)[2] is False
    dtype, why, bf16_weights = kernels.auto_dtype("bfloat16", False)
    if kernels.load() is not None:  # bf16 weights kept, float32 activations on lmforge's kernels
        assert (dtype, bf16_weights) == ("float32", True)
        want = ("has bf16 units", "oneDNN's bf16 GEMM") if has_bf16 == "1" else ("without bf16 units",)
        assert all(w in why for w in want)
    else:
        assert (dtype, bf16_weights) == ("bfloat16", False)
    assert kernels.auto_dtype("float16", False)[0] == "bfloat16"


def test_engine_reports_the_choice(folders, monkeypatch, caplog):
    monkeypatch.setenv("LMFORGE_CPU_BF16", "0")
    with caplog.at_level(logging.INFO, logger="lmforge.engine"):
        s = LLM(str(folders["bfloat16"]), device="cpu").llm_engine.stats()
    want = ("float32", "bits 16") if kernels.load() is not None else ("bfloat16", "")
    assert s["dtype"] == want[0] and "without bf16 units" in s["dtype_choice"] and want[1] in s["linear_backend"]
    assert "without bf16 units" in caplog.text and "engine ready" in caplog.text
    s = LLM(str(folders["float32"]), device="cpu").llm_engine.stats()
    assert s["dtype"] == "float32" and "kept" in s["dtype_choice"]
    assert ("bits 32" in s["linear_backend"]) == (kernels.load() is not None)  # its layers on lmf_qmm_f32
    s = LLM(str(folders["float32"]), device="cpu", dtype="bfloat16").llm_engine.stats()
    assert s["dtype"] == "bfloat16" and s["dtype_choice"] == "set by --dtype"


@pytest.mark.skipif(kernels.load() is None, reason="no C compiler: lmforge's CPU kernels are absent")
def test_quantized_checkpoint_runs_integer_kernels_and_metrics_say_so(folders):
    """A w8a16 folder saved in bf16 used to run torch's bf16 int8 kernel under auto; now float32
    activations on lmforge's integer kernels: by default (`--quant-activations auto`) int8 activations on the
    A8 body where the CPU has VNNI or AVX2, the exact lmf_qmm_f32 when asked (`none`), and `/metrics` carries
    it in `lmforge:kernel_info`."""
    default = LLM(str(folders["w8"]), device="cpu").llm_engine.stats()
    lib = kernels.load()
    a8 = lib is not None and kernels.a8_isa(lib) != "portable"
    assert default["quant_activations"] == ("int8" if a8 else "none")
    assert ("lmf_qmm_a8" if a8 else "lmf_qmm_f32") in default["linear_backend"]
    stats = LLM(str(folders["w8"]), device="cpu", quant_activations="none").llm_engine.stats()
    assert stats["dtype"] == "float32" and "lmf_qmm_f32" in stats["linear_backend"]
    assert stats["quant_activations_choice"] == "set by --quant-activations"
    registry = CollectorRegistry()
    registry.register(EngineCollector(lambda: {"v1": {**stats, "num_requests_running": 0, "num_requests_waiting": 0,
                                                      "kv_blocks_in_use": 0, "kv_blocks_total": 1, "preemptions": 0,
                                                      "prefix_cache_queries": 0, "prefix_cache_hits": 0}}, "tiny"))
    text = generate_latest(registry).decode()
    line = next(x for x in text.splitlines() if x.startswith("lmforge:kernel_info{"))
    assert 'dtype="float32"' in line and "lmf_qmm_f32" in line and line.endswith(" 1.0")


@pytest.mark.skipif(kernels.load() is None, reason="no C compiler: lmforge's CPU kernels are absent")
def test_bf16_weights_on_float32_activations_are_the_float32_model(folders, monkeypatch):
    """A bf16 checkpoint on a CPU without bf16 units keeps 2-byte weights (`QmmLinear.from_bf16`: decode rows
    on `lmf_qmm_f32` with bits 16, a 40-token prompt on the panel GEMM `lmf_gemm_f32`, or without its AVX2
    body above 32 rows on the widened weight) and computes in
    float32 over a bf16 K/V cache (`--kv-cache-dtype auto`): the greedy tokens are the float32 engine's on the
    same weights and K/V; with float32 K/V, transformers' float32 `generate`; the weights take half the bytes;
    the trainer's in-place weight sync is refused."""
    import transformers

    from lmforge.quant.linear import QmmLinear

    monkeypatch.setenv("LMFORGE_CPU_BF16", "0")
    prompts = [[1, 5, 9, 12], [3, 4], list(range(10, 50))]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm = LLM(str(folders["bfloat16"]), device="cpu")
    runner = llm.llm_engine.model_runner
    assert runner.bf16_linears > 0 and all(m.bits == 16 for m in runner.model.modules() if isinstance(m, QmmLinear))
    assert ("prefill on lmf_gemm_f32" in runner.linear_backend) is kernels.load().gemm_ok  # the 40-token prompt
    assert runner.attn.kv.store_dtype == torch.bfloat16 and "bf16 K/V" in llm.stats()["kv_cache_dtype_choice"]
    fast = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    f32 = LLM(str(folders["bfloat16"]), device="cpu", dtype="float32", kv_cache_dtype="bfloat16")
    assert fast == [o.outputs[0].token_ids for o in f32.generate(prompts, params, use_tqdm=False)]
    assert runner.weight_bytes < 0.6 * f32.llm_engine.model_runner.weight_bytes
    exact = LLM(str(folders["bfloat16"]), device="cpu", kv_cache_dtype="float32")
    assert exact.llm_engine.model_runner.bf16_linears > 0
    exact_toks = [o.outputs[0].token_ids for o in exact.generate(prompts, params, use_tqdm=False)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders["bfloat16"], dtype=torch.float32)
    for p, toks in zip(prompts, exact_toks):
        out = hf.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert out[0, len(p):].tolist() == toks
    with pytest.raises(ValueError):
        llm.load_weights(f32.llm_engine.model.state_dict())


def test_bf16_units_run_decode_on_the_float32_kernels_and_prefill_on_bf16(folders, monkeypatch):
    """A bf16 checkpoint on a CPU with bf16 units (forced here on any CPU) keeps the float32 kernels for steps
    under the bf16 threshold, so a one-token prompt decoding alone is the float32 engine's up to summation
    order, and from that many rows runs on bf16 dot products over the bf16 weight: lmforge's bf16 panel GEMM
    where the CPU has AVX512-BF16 (from `lmf_bf16_panel_rows()` rows), else oneDNN's bf16 GEMM (its emulation
    on a CPU without bf16 units; from `BF16_UNITS_ROWS`). A long prompt's logits are the bf16 model's
    rounding of the float32 ones, not the float32 ones exactly."""
    from lmforge.quant.linear import QmmLinear

    monkeypatch.setenv("LMFORGE_CPU_BF16", "1")
    llm = LLM(str(folders["bfloat16"]), device="cpu", enable_prefix_caching=False)
    runner = llm.llm_engine.model_runner
    assert llm.stats()["dtype"] == "float32" and "bf16 units" in llm.stats()["dtype_choice"]
    lib = kernels.load()
    panel = lib.bf16_panel_rows(-1) if lib is not None and lib.bf16_panel_rows is not None else 0
    want = "its bf16 panel GEMM" if panel else "oneDNN bf16 GEMM"
    assert runner.bf16_linears > 0 and want in runner.linear_backend
    q = next(m for m in runner.model.modules() if isinstance(m, QmmLinear))
    assert q.bf16_panel_rows == panel
    x = torch.randn(panel or QmmLinear.BF16_UNITS_ROWS, q.K)
    w = q.dequantized().clone()  # the weight as rows, whichever layout the layer stores
    few, many = q(x[:-1]), q(x)  # the float32 kernel; then bf16 dot products on bf16-rounded activations
    torch.testing.assert_close(few, x[:-1] @ w.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(many, x.bfloat16().float() @ w.T, rtol=2e-2, atol=2e-2)
    assert not torch.equal(many[:-1], few)  # the long call did take the other path
    f32 = LLM(str(folders["bfloat16"]), device="cpu", dtype="float32", enable_prefix_caching=False,
              kv_cache_dtype="bfloat16")  # the same bf16 K/V cache as the bf16 checkpoint's auto choice
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    a, b = (l.generate([[7]], params, use_tqdm=False)[0].outputs[0] for l in (llm, f32))
    assert a.token_ids == b.token_ids  # one row a step: the exact path throughout
    for x, y in zip(a.logprobs, b.logprobs):
        assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)
    long = list(range(10, 50))
    a, b = (l.generate([long], params, use_tqdm=False)[0].outputs[0] for l in (llm, f32))
    assert a.token_ids[:4] == b.token_ids[:4]  # the prefill in bf16: the same model up to bf16 rounding


@pytest.mark.skipif(kernels.load() is None, reason="no C compiler: lmforge's CPU kernels are absent")
@pytest.mark.parametrize("portable", [False, True])
def test_qmm_f32_bits_16_is_the_float32_matmul_of_the_bf16_weight(portable):
    """`lmf_qmm_f32` with bits 16 (the AVX2 body and the portable one): the float32 product of the widened
    bf16 weight, for 1 to 5 rows (the 4-row blocks and a remainder), K with a tail past the 32-wide loop."""
    from torch import nn

    from lmforge.quant.linear import QmmLinear

    lib = kernels.load(("-DLMF_PORTABLE",)) if portable else kernels.load()
    assert lib.gemm_ok is (not portable and kernels.load().gemm_ok)  # the portable build has no panel GEMM
    torch.manual_seed(0)
    for K, c_gemm in ((256, False), (200, False), (256, True), (203, True)):
        lin = nn.Linear(K, 45, bias=True).to(torch.bfloat16)
        layer = QmmLinear.from_bf16(lin, lib.qmm_f32, c_gemm=c_gemm and lib.gemm_ok)
        # with c_gemm, from GEMM_MIN_ROWS rows lmf_gemm_f32 inside lmf_qmm_f32; without, the row kernel up to
        # MAX_ROWS and above (40) the widened weight and sgemm
        for M in (1, 2, 3, 4, 5, 11, 12, 13, 40):
            x = torch.randn(M, K)
            want = x @ lin.weight.float().T + lin.bias.float()
            torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="bfloat16"):
        QmmLinear.from_bf16(nn.Linear(32, 8), lib.qmm_f32)


@pytest.mark.skipif(kernels.load() is None or not kernels.load().gemm_ok,
                    reason="no AVX2 + FMA body of lmf_gemm_f32 in this build")
@pytest.mark.parametrize("bits", [16, 32])
def test_panel_gemm_is_the_float64_product_at_every_tail(bits):
    """`lmf_gemm_f32` (prefill chunks of bf16 weights): 6 x 16 register tiles over (K, 16) panels, so every
    remainder is a case: rows 1-5 past the last 6 (and fewer rows than a tile), columns past the last 16
    (and fewer than one panel), K not a multiple of the 8 x 8 transpose; 1 and 2 threads. Against the float64
    product of the same (widened) weights: only the float32 summation order differs."""
    lib = kernels.load()
    g = torch.Generator().manual_seed(bits)
    for M, N, K in ((1, 1, 1), (5, 15, 7), (6, 16, 8), (7, 17, 203), (13, 45, 64), (40, 33, 256), (101, 130, 96)):
        x = torch.randn(M, K, generator=g)
        w = torch.randn(N, K, generator=g)
        w = w.to(torch.bfloat16) if bits == 16 else w
        want = x.double() @ w.double().T
        for threads in (1, 2):
            out = torch.full((M, N), float("nan"))
            assert lib.gemm_f32(x.data_ptr(), w.data_ptr(), None, out.data_ptr(), M, N, K, bits, 0, threads, None) == 0
            err = (out.double() - want).abs().max().item()
            assert err <= 1e-5 * max(want.abs().max().item(), 1.0), (M, N, K, threads, err)
    x, out = torch.randn(2, 8), torch.empty(2, 4)
    assert lib.gemm_f32(x.data_ptr(), torch.zeros(4, 8, dtype=torch.int8).data_ptr(), None, out.data_ptr(), 2, 4, 8, 8,
                        0, 1, None) == -1  # int8 codes need their scales
    assert lib.gemm_f32(x.data_ptr(), x.data_ptr(), None, out.data_ptr(), 2, 4, 8, 12, 0, 1, None) == -1  # no such bits


def _bf16_panel_rows() -> int:
    lib = kernels.load()
    return lib.bf16_panel_rows(-1) if lib is not None and lib.bf16_panel_rows is not None else 0


def test_bf16_panel_gemm_is_the_float64_product_of_rounded_activations():
    """`lmf_gemm_bf16` (many rows of bf16 weights on AVX512-BF16): 12 rows x 2 panels of 16 weight rows, so
    every remainder is a case (rows past the last 12, a last single panel, a panel short of 16 rows), per-row
    scales, 1-3 threads; against the float64 product of the bf16-rounded activations and the bf16 weights.
    Where the CPU or build lacks the body it refuses (-1): callers keep their other paths."""
    lib = kernels.load()
    if lib is None:
        pytest.skip("no C compiler: lmforge's CPU kernels are absent")
    has = _bf16_panel_rows() > 0
    assert has is ({"avx512_bf16", "avx512bw", "avx512vl"} <= set(kernels._cpu_flags().split()))
    g = torch.Generator().manual_seed(16)
    for M, N, K in ((1, 16, 32), (5, 45, 64), (12, 32, 96), (13, 80, 1024), (37, 17, 64), (100, 130, 256)):
        x = torch.randn(M, K, generator=g) * 3
        w = torch.randn(N, K, generator=g).to(torch.bfloat16)
        scale = torch.rand(N, generator=g) + 0.5
        want = (x.bfloat16().double() @ w.double().T) * scale.double()
        for threads in (1, 2, 3):
            out = torch.full((M, N), float("nan"))
            rc = lib.gemm_bf16(x.data_ptr(), w.data_ptr(), scale.data_ptr(), out.data_ptr(), M, N, K, threads, 0)
            assert rc == (0 if has else -1)
            if has:
                err = (out.double() - want).abs().max().item()
                assert err <= 1e-5 * max(want.abs().max().item(), 1.0), (M, N, K, threads, err)
    x, w, out = torch.randn(2, 40), torch.zeros(4, 40, dtype=torch.bfloat16), torch.empty(2, 4)
    assert lib.gemm_bf16(x.data_ptr(), w.data_ptr(), torch.ones(4).data_ptr(), out.data_ptr(), 2, 4, 40, 1, 0) == -1  # K % 32
