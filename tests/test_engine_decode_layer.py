"""A decoder layer of an all-decode step as one C call (`lmforge.engine.decode_layer`): on int8 and int4
models (per channel and in groups of 32, GGUF's Q8_0 / Q4_0 layout), A16 and A8, on a bf16 checkpoint
in the float32-activation form a CPU without bf16 units gets (bf16 weights, bits 16) and on a float32
model (its weights as they are, bits 32), one sequence and
several, the engine's greedy tokens and their log-probabilities are the module path's bit for bit (the
same kernels in the same order); prefill steps keep the module path; a model it cannot take keeps its
modules and says why."""

from __future__ import annotations

import pytest
import torch

from lmforge.engine import LLM, SamplingParams, kernels
from lmforge.engine.decode_layer import CDecodeLayer
from lmforge.model.reference import save_hf_model
from lmforge.quant.quantize import QuantizeConfig, quantize_model

LIB = kernels.load()
pytestmark = pytest.mark.skipif(LIB is None, reason=f"no compiled kernels: {kernels.status()}")
PROMPTS = [[1, 5, 9, 13, 200, 31], [1, 77, 8], [1, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 40]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode_layer")
    src = save_hf_model("llama", root / "src", seed=5, hidden_size=128, vocab_size=256, layers=3,
                        intermediate_size=192, max_position_embeddings=256)  # head_dim 32: the C attention
    out = {"src": src, "bf16": save_hf_model("llama", root / "bf16", seed=5, hidden_size=128, vocab_size=256, layers=3,
                                              intermediate_size=192, max_position_embeddings=256, dtype=torch.bfloat16)}
    for name, scheme, gs in (("w8", "w8a16", None), ("w4", "w4a16", 32)):
        quantize_model(QuantizeConfig(model=str(src), out=str(root / name), scheme=scheme, group_size=gs or 128))
        out[name] = root / name
    return out


def _count_rows(runner, calls: list[int]) -> None:
    """Record the rows of every C call (a layer's, or the whole stack's) the runner's layers make."""
    for layer in runner.model.model.layers:
        real = layer.lib
        layer.lib = type("L", (), {
            "decode_layer_q": staticmethod(lambda *a, real=real: calls.append(a[3]) or real.decode_layer_q(*a)),
            "decode_stack_q": staticmethod(lambda *a, real=real: calls.append(a[4]) or real.decode_stack_q(*a))})


def _run(llm: LLM, modules: bool) -> list[tuple[list[int], list[float]]]:
    layers = llm.llm_engine.model_runner.model.model.layers
    saved = list(layers)
    if modules:  # the module path: each stand-in's own DecoderLayer back in place
        for i, layer in enumerate(layers):
            layers[i] = layer.layer if isinstance(layer, CDecodeLayer) else layer
    try:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [lp[t] for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
                for o in outs]
    finally:
        for i, layer in enumerate(saved):
            layers[i] = layer


@pytest.mark.parametrize("name,qa,kv", [("w8", "none", "auto"), ("w8", "int8", "auto"), ("w4", "none", "auto"),
                                        ("w4", "int8", "auto"), ("bf16", "none", "auto"), ("src", "none", "auto"),
                                        ("src", "none", "bfloat16")])
def test_c_layer_step_is_the_module_path_bit_for_bit(models, name, qa, kv, monkeypatch):
    """`--kv-cache-dtype auto` keeps float32 K/V on the exact paths (A16, a float32 model) and bf16 K/V under
    A8 and for the bf16 checkpoint (the C layer writes it rounded, as the module path's write does)."""
    monkeypatch.setenv("LMFORGE_CPU_BF16", "0")  # bf16: `--dtype auto` as on a CPU without bf16 units
    llm = LLM(str(models[name]), dtype="auto" if name == "bf16" else "float32", device="cpu", quant_activations=qa,
              enable_prefix_caching=False, kv_cache_dtype=kv)
    runner = llm.llm_engine.model_runner
    assert (runner.bf16_linears > 0) == (name == "bf16") and runner.dtype == torch.float32
    bf16_kv = qa == "int8" or name == "bf16" or kv == "bfloat16"
    assert runner.attn.kv.store_dtype == (torch.bfloat16 if bf16_kv else torch.float32)
    assert llm.llm_engine.config.kv_cache_dtype == ("bfloat16" if bf16_kv else "float32")
    assert int(runner.model.model.layers[0].params[12]) == int(not bf16_kv)  # the pool kind
    # the float32 model: its layers' linears are the weights themselves on lmf_qmm_f32 (bits 32), the head packed
    assert runner.f32_layer_linears == (3 * 4 if name == "src" else 0)
    if name == "src":
        assert runner.packed_linears == 1  # the LM head
    assert runner.decode_layers == 3, runner.decode_layers_why
    layers = runner.model.model.layers
    assert all(m.stack is not None and m.index == i for i, m in enumerate(layers))  # one C call a step
    calls, later = [], []
    _count_rows(runner, calls)  # count the C calls (a prefill step must not make any)
    real = type(layers[1]).forward  # the later layers: called on prefill steps only (the backbone skips them)
    layers[1].forward = lambda *a, **k: later.append(1) or real(layers[1], *a, **k)
    fast = _run(llm, modules=False)
    del layers[1].forward
    slow = _run(llm, modules=True)
    assert fast == slow
    # 11 decode steps after each prefill; the three sequences decode together: rows per call 1..3
    assert calls and max(calls) == 3 and set(calls) <= {1, 2, 3}
    decode_steps = len(calls)
    assert 0 < len(later) < decode_steps  # prefill steps only
    for m in layers:  # a call a layer (LMFORGE_DECODE_STACK=0): the same bits, 3 calls a step
        m.stack = None
    calls.clear()
    assert _run(llm, modules=False) == fast and len(calls) == 3 * decode_steps


def test_models_it_cannot_take_keep_their_modules(models):
    bf16 = LLM(str(models["src"]), dtype="bfloat16", device="cpu")  # packed bf16 linears: the module path
    assert bf16.llm_engine.model_runner.decode_layers == 0
    # bf16 activations; on a CPU without bf16 units nothing is packed, so nothing is fused either
    assert any(w in bf16.llm_engine.model_runner.decode_layers_why for w in ("float32", "one projection"))
    int8kv = LLM(str(models["w8"]), dtype="float32", device="cpu", kv_cache_dtype="int8")
    assert int8kv.llm_engine.model_runner.decode_layers == 0
    assert "K/V pool" in int8kv.llm_engine.model_runner.decode_layers_why
    ref = LLM(str(models["w8"]), dtype="float32", device="cpu", attention="reference")
    assert ref.llm_engine.model_runner.decode_layers == 0
    off = LLM(str(models["src"]), dtype="float32", device="cpu", cpu_kernels=False)  # float32 without the kernels
    assert off.llm_engine.model_runner.decode_layers == 0 and off.llm_engine.model_runner.f32_layer_linears == 0
    lora = LLM(str(models["w8"]), dtype="float32", device="cpu", enable_lora=True)  # LoRA wraps q/k/v: not fused
    assert lora.llm_engine.model_runner.decode_layers == 0


def _greedy_with_logprobs(llm, prompts) -> list:
    """Each prompt's 6 greedy tokens with the log-probability of each."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t] for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outs]


def _on_the_module_path(runner, fn):
    """fn() with every C decoder layer swapped for the module it wraps, restored after."""
    layers = runner.model.model.layers
    saved = list(layers)
    for i, lay in enumerate(layers):
        layers[i] = lay.layer
    try:
        return fn()
    finally:
        for i, lay in enumerate(saved):
            layers[i] = lay


@pytest.mark.parametrize("name", ["w4", "src"])
def test_c_layer_batch_on_the_panel_gemm_is_the_module_path_bit_for_bit(models, name):
    """Enough sequences decoding together that the layer's matmuls cross `QmmLinear.GEMM_MIN_ROWS` (the panel
    GEMM inside `lmf_qmm_f32`, passed to the C layer as its `gemm_rows`): still the module path's bits."""
    from lmforge.quant.linear import QmmLinear

    llm = LLM(str(models[name]), dtype="float32", device="cpu", enable_prefix_caching=False, quant_activations="none")
    runner = llm.llm_engine.model_runner
    layer = runner.model.model.layers[0]
    qkv = layer.layer.self_attn.qkv_proj
    want = QmmLinear.GEMM_MIN_ROWS[qkv.bits] if LIB.gemm_ok else 0
    assert qkv.gemm_rows == want and int(layer.params[15 + 5]) == want  # the first linear's gemm_rows
    calls, prompts = [], [[1, 2 + i, 7, 3 * i + 1] for i in range(14)]
    _count_rows(runner, calls)
    fast = _greedy_with_logprobs(llm, prompts)
    assert max(calls) == len(prompts) >= QmmLinear.GEMM_MIN_ROWS[qkv.bits]  # one C call a step for all 14 rows
    assert fast == _on_the_module_path(runner, lambda: _greedy_with_logprobs(llm, prompts))


@pytest.mark.skipif(LIB is None or not LIB.bf16_panel_rows or LIB.bf16_panel_rows(-1) == 0,
                    reason="this CPU or build has no bf16 panel GEMM (AVX512-BF16)")
def test_c_layer_batch_on_the_bf16_panel_is_the_module_path_bit_for_bit(models):
    """A bf16 checkpoint on a CPU with bf16 units: from `lmf_bf16_panel_rows()` rows its linears run on the bf16
    panel GEMM (`bf16_rows`, the 7th value of each linear in the C layer's parameters), so a decode batch of 14
    stays in one C call a step, with the module path's bits."""
    llm = LLM(str(models["bf16"]), device="cpu", enable_prefix_caching=False)
    runner = llm.llm_engine.model_runner
    rows = LIB.bf16_panel_rows(-1)
    layer = runner.model.model.layers[0]
    qkv = layer.layer.self_attn.qkv_proj
    assert runner.decode_layers == 3, runner.decode_layers_why
    assert qkv.bf16_panel_rows == rows and int(layer.params[15 + 6]) == rows and "bf16 panel" in runner.linear_backend
    calls, prompts = [], [[1, 2 + i, 7, 3 * i + 1] for i in range(14)]
    _count_rows(runner, calls)
    fast = _greedy_with_logprobs(llm, prompts)
    assert max(calls) == len(prompts) >= rows  # one C call a step for all 14 rows
    assert fast == _on_the_module_path(runner, lambda: _greedy_with_logprobs(llm, prompts))
