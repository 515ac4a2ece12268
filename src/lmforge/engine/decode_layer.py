"""A decoder layer of a decode step as one C call (`lmf_decode_layer_q`), for int8/int4-weight models on
float32 activations (the GGUF block types and w8a16 / w4a16 checkpoints a CPU user serves; each linear in its
own format, so a Q4_K_M file's layers, which mix Q4_K and Q6_K, keep q, k and v apart) and bf16
checkpoints in their float32-activation form on CPUs without bf16 units (`QmmLinear.from_bf16`, bits 16),
and float32 models (`QmmLinear.from_f32`, bits 32: the weights as they are, up to 16 rows a step).

Why: at batch 1 a 24-layer model's step spent ~8 ms of ~28 in the Python module tree around the
kernels (module calls, reshapes, the small torch ops between the C calls; `scripts/decode_step_profile.py`),
a third of the step, and most of it at batch 1 is interpreter time, not arithmetic. The C function runs
the very kernels the module path calls (RMSNorm, the fused q/k/v matmul, RoPE, the K/V write into a
float32 or bf16 pool, paged decode attention, o_proj, RMSNorm, gate/up, SiLU x up, down, the residual
adds), in the same order, so a step gives the same bits either way (`tests/test_engine_decode_layer.py`).

`CDecodeLayer` stands in for a `DecoderLayer` (as the other engine-only stand-ins of `fused.py` do): on
a step where every row decodes (no prefill chunk), at most `QmmLinear.A8_MAX_ROWS` (A8) or
`MAX_ROWS` (A16) rows, it makes the one call; any other step takes the module path unchanged. Where
every layer decides alike, the first runs the whole stack in one `lmf_decode_stack_q` call and the
others pass its result on (`LMFORGE_DECODE_STACK=0`: a call a layer; `python scripts/kernels_ab.py stack
MODEL` compares the two: 1-4% of a Q4_0 step of the random 300M).
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

from lmforge.model.transformer import DecoderLayer
from lmforge.quant.linear import QmmLinear

from .fused import FusedAttention, FusedMLP, FusedRMSNorm
from .kernels import A8_ISAS, CpuKernels


def _why_not(layer: DecoderLayer, backend) -> str | None:
    """None when `lmf_decode_layer_q` computes this layer exactly as its modules do, else why not."""
    attn, mlp = layer.self_attn, layer.mlp
    if type(backend).__name__ != "KernelBackend" or getattr(backend.kv, "int8", False):
        return "attention is not the C kernels on a float K/V pool"
    if backend.kv.store_dtype not in (torch.float32, torch.bfloat16):
        return "the K/V pool is neither float32 nor bfloat16"
    if not (isinstance(attn, FusedAttention) and attn.q_norm is None):
        return "the attention block is not the fused one (or the model has q/k norms)"
    if not isinstance(mlp, FusedMLP):
        return "the MLP is not the fused one"
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if not all(isinstance(n, FusedRMSNorm) and n.weight.dtype == torch.float32 for n in norms):
        return "the norms are not the float32 C kernel"
    if norms[0].variance_epsilon != norms[1].variance_epsilon:
        return "the two norms differ in eps"
    lins = _linears(layer)
    if not all(isinstance(m, QmmLinear) and m.bias is None and (m.a8 is not None or m.qmm is not None) for m in lins):
        return "the linears are not lmforge's int8/int4/bf16/float32-weight kernels without bias"
    if len({(m.threads, m.a8 is None, m.a8.isa if m.a8 is not None else None) for m in lins}) > 1:
        return "the linears differ in threads or activation kind"
    return None


def _linears(layer: DecoderLayer) -> list[nn.Module]:
    """The layer's matmuls in `lmf_decode_layer_q`'s order: qkv (or q, k, v), o, gate_up (or gate, up), down. A
    GGUF file may give a layer's projections different formats (a Q4_K_M file's v in Q6_K), so they stay apart."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = [attn.qkv_proj] if "qkv_proj" in attn._modules else [attn.q_proj, attn.k_proj, attn.v_proj]
    gu = [mlp.gate_up_proj] if "gate_up_proj" in mlp._modules else [mlp.gate_proj, mlp.up_proj]
    return [*qkv, attn.o_proj, *gu, mlp.down_proj]


def _linear_params(m: QmmLinear) -> list[int]:
    """A linear's LIN values of the parameter array: codes, float32 scales, the scales' descriptor (0: none, the
    float32 scales alone), bits, gs, gemm_rows, bf16_rows (from how many rows the bf16 panel GEMM; 0 never)."""
    return [m.codes.data_ptr(), m.scale.data_ptr(), m.desc_ptr or 0, m.bits, _kernel_gs(m), m.gemm_rows,
            m.bf16_panel_rows]


def _kernel_gs(m: QmmLinear) -> int:
    """The group size as the C kernels take it: 0 (<= 0) for one scale a row (per channel)."""
    return m.gs if m.gs != m.K else 0


class CDecodeLayer(nn.Module):
    """A `DecoderLayer` whose all-decode steps run as one `lmf_decode_layer_q` call; or, as one of a stack
    (`stack` set, `index` its place), the first layer runs every layer of the step in one
    `lmf_decode_stack_q` call and the others hand the result on."""

    stack: torch.Tensor | None = None  # (layers,) int64: each layer's `params` address (set by `install`)
    index = 0

    def __init__(self, layer: DecoderLayer, backend, lib: CpuKernels):
        super().__init__()
        self.layer, self.backend, self.lib = layer, backend, lib
        attn, mlp = layer.self_attn, layer.mlp
        lins = _linears(layer)
        first, down = lins[0], lins[-1]
        self.isa = A8_ISAS[first.a8.isa] if first.a8 is not None else -1
        # the most rows every linear takes on its C kernel (A8's cap, or each A16 layer's own; bits 32: its own);
        # steps that would reach oneDNN's bf16 GEMM take the module path
        self.max_rows = min(QmmLinear.A8_MAX_ROWS if m.a8 is not None else m.MAX_ROWS for m in lins)
        self.max_rows = min([self.max_rows] + [m.bf16_rows - 1 for m in lins if m.bf16_rows])
        k_pool, v_pool = backend.kv.rows(attn.layer_idx)
        self.layer_idx, self.eps, self.scale = attn.layer_idx, layer.input_layernorm.variance_epsilon, attn.head_dim ** -0.5
        p = [layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(), attn.o_proj.N,
             attn.n_heads, attn.n_kv_heads, attn.head_dim, down.K, backend.kv.block_size,
             k_pool.data_ptr(), v_pool.data_ptr(), first.threads, torch.get_num_threads(),
             int(k_pool.dtype == torch.float32), int("qkv_proj" not in attn._modules),
             int("gate_up_proj" not in mlp._modules)]
        for m in lins:
            p += _linear_params(m)
        self.params = torch.tensor(p, dtype=torch.int64)  # kept alive: the C call reads it every step

    def takes(self, x_BTD: torch.Tensor, attn) -> bool:
        """This step runs as the C call: every row decodes (no prefill chunk, no groups), within the row cap."""
        meta = getattr(self.backend, "meta", None)
        return not (attn is not self.backend or meta is None or meta.decode is None or meta.groups
                    or getattr(meta, "prefill", None) is not None or x_BTD.shape[0] * x_BTD.shape[1] > self.max_rows
                    or x_BTD.dtype != torch.float32)

    def forward(self, x_BTD: torch.Tensor, cos_BTH, sin_BTH, attn) -> torch.Tensor:
        if not self.takes(x_BTD, attn):
            return self.layer(x_BTD, cos_BTH, sin_BTH, attn)
        if self.stack is not None and self.index:
            return x_BTD  # the first layer ran this step through every layer
        meta = self.backend.meta
        M = x_BTD.shape[0] * x_BTD.shape[1]
        rows_S, lens_S, tables_SM = meta.decode
        x = x_BTD.clone(memory_format=torch.contiguous_format)  # the residual stream, updated in place by C
        cos, sin = cos_BTH.contiguous(), sin_BTH.contiguous()
        step = (x.data_ptr(), M, cos.data_ptr(), sin.data_ptr(), meta.slot_mapping_T.data_ptr(), tables_SM.data_ptr(),
                tables_SM.shape[1], lens_S.data_ptr(), rows_S.data_ptr(), len(rows_S), self.eps, self.scale)
        if self.stack is not None:
            rc = self.lib.decode_stack_q(self.isa, len(self.stack), self.stack.data_ptr(), *step)
        else:
            rc = self.lib.decode_layer_q(self.isa, self.params.data_ptr(), *step)
        if rc != 0:
            raise RuntimeError(f"lmf_decode_layer_q refused layer {self.layer_idx} (code {rc})")
        return x


def install(model: nn.Module, backend, lib: CpuKernels | None) -> tuple[int, str | None]:
    """Swap every eligible `DecoderLayer` of `model` for a `CDecodeLayer` (all or none); returns (how many,
    why none when none)."""
    if lib is None or lib.decode_layer_q is None:
        return 0, "no compiled kernels"
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return 0, "not a decoder stack"
    for layer in layers:
        why = _why_not(layer, backend)
        if why is not None:
            return 0, why
    for i, layer in enumerate(layers):
        layers[i] = CDecodeLayer(layer, backend, lib)
    # one call a step for the whole stack, where every layer takes the C path on the same steps (same row cap,
    # body, eps and scale) and the library has it
    same = len({(m.max_rows, m.isa, m.eps, m.scale) for m in layers}) == 1
    if lib.decode_stack_q is not None and same and os.environ.get("LMFORGE_DECODE_STACK", "1") != "0":
        stack = torch.tensor([m.params.data_ptr() for m in layers], dtype=torch.int64)
        for i, m in enumerate(layers):
            m.stack, m.index = stack, i
        backbone = model.model
        backbone.run_layers = functools.partial(_run_stack, backbone)  # this instance only
    return len(layers), None


def _run_stack(backbone: nn.Module, x_BTD: torch.Tensor, cos_BTH, sin_BTH, attn) -> torch.Tensor:
    """`Backbone.run_layers` where the first layer runs the whole stack: on such a step the other layers are not called
    at all (each call only handed the result on: ~3 us a layer at batch 1, the interpreter's caches cold after the
    C call; 0.07 ms of the random 300M's Q4_0 step); any other step is the model's own loop."""
    first = backbone.layers[0]
    if isinstance(first, CDecodeLayer) and first.stack is not None and first.takes(x_BTD, attn):
        return first(x_BTD, cos_BTH, sin_BTH, attn)
    return type(backbone).run_layers(backbone, x_BTD, cos_BTH, sin_BTH, attn)
