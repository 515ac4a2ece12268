"""Engine-only stand-ins for a loaded model's RMSNorm, attention block and MLP that run their
elementwise work through the compiled CPU kernels (`lmforge.engine.kernels`), bfloat16 or float32 (the `_f32` bodies, for CPUs without native bf16).

Why: at a decode step's few rows, each torch op costs microseconds of dispatch whatever its size,
and at a 2,048-token prefill chunk the bf16 elementwise ops (RoPE's four products and the cat,
RMSNorm's float32 round trip, silu then multiply) took more time than the linear layers. One C call
replaces 8 ops for an RMSNorm, ~14 for RoPE on q and k, 2 for SwiGLU's middle. Each kernel rounds
as the torch ops it replaces, so the outputs stay within float32 summation-order noise of the torch
path (`tests/test_engine_kernels.py`).

With `fuse_projections` (before the linear backends are chosen) q/k/v become one `qkv_proj` and
gate/up one `gate_up_proj`, their weights (float, or int codes with their scales) concatenated along
the output: a decode step then makes 4 matmul calls a layer, not 7, each reading a larger weight (at
batch 1 each call's fixed cost, thread start and the first cache lines, is paid 97 times a step on a
24-layer model instead of 169). The outputs are the same numbers: every output row of a matmul is
its own dot product.

The model's own modules (`lmforge.model.transformer`) stay plain: the model runner swaps these in
after loading, as it swaps `PackedLinear` in for `nn.Linear`. The swapped model is inference-only.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from lmforge.model.transformer import MLP, Attention, RMSNorm
from lmforge.quant.linear import QmmLinear, QuantizedLinear

from .attention.kv_pool import token_rows
from .kernels import MAX_H, CpuKernels


def _kernel(lib: CpuKernels, name: str, dtype: torch.dtype):
    return getattr(lib, name if dtype == torch.bfloat16 else f"{name}_f32")


class FusedRMSNorm(nn.Module):
    def __init__(self, norm: RMSNorm, lib: CpuKernels):
        super().__init__()
        self.weight = norm.weight.detach().contiguous()
        self.variance_epsilon, self.lib = norm.variance_epsilon, lib
        self.fn = _kernel(lib, "rmsnorm", self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        D = x.shape[-1]
        self.fn(x.data_ptr(), self.weight.data_ptr(), out.data_ptr(), x.numel() // D, D, self.variance_epsilon,
                torch.get_num_threads())
        return out


def _cat_rows(ts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat along rows, on one thread for CPU tensors (numpy): at load, torch's pool would make every small
    copy wait for a second core a busy machine may not give (16-24 ms a cat of 1.5 MB of codes, 0.02 on one)."""
    if ts[0].device.type != "cpu" or ts[0].dtype == torch.bfloat16:
        return torch.cat(ts)
    return torch.from_numpy(np.concatenate([t.numpy() for t in ts]))


def concat_linears(mods: list[nn.Module]) -> nn.Module | None:
    """One linear computing `mods`' outputs side by side (same input), or None when they differ in kind,
    input size, quantization scheme or bias. Float: `nn.Linear`; int codes: `QuantizedLinear`."""
    first = mods[0]
    same_bias = all((m.bias is None) == (first.bias is None) for m in mods)
    if not same_bias or any(m.in_features != first.in_features for m in mods):
        return None
    bias = None if first.bias is None else torch.cat([m.bias.detach() for m in mods])
    if all(type(m) is nn.Linear for m in mods):
        w = torch.cat([m.weight.detach() for m in mods])
        lin = nn.Linear(first.in_features, w.shape[0], bias=bias is not None, device="meta")
        lin.weight = nn.Parameter(w, requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias, requires_grad=False)
        return lin
    same_form = lambda m: (m.scheme, m.weight_scale.dtype, m.scale_per, m.packed)  # noqa: E731
    if all(type(m) is QuantizedLinear and same_form(m) == same_form(first) for m in mods):
        q = QuantizedLinear(first.in_features, sum(m.out_features for m in mods), first.scheme,
                            bias=bias is not None, scale_dtype=first.weight_scale.dtype, device="meta",
                            packed=first.packed, scale_per=first.scale_per)
        for name, _ in first.named_buffers():  # codes, scales, zeros and super-block scales: rows side by side
            setattr(q, name, _cat_rows([m.get_buffer(name) for m in mods]))
        if bias is not None:
            q.bias = nn.Parameter(bias, requires_grad=False)
        return q
    return None


def fuse_projections(model: nn.Module) -> int:
    """Give every attention block whose RoPE the kernels take a `qkv_proj` and every MLP a `gate_up_proj`
    (the separate projections are dropped); returns how many were fused. Run it before the linear
    backends are swapped in, and only where `fuse_elementwise` follows (its stand-ins call the fused
    projections)."""
    n = 0
    for m in model.modules():
        if isinstance(m, Attention) and m.head_dim % 2 == 0 and m.head_dim <= MAX_H:
            fused = concat_linears([m.q_proj, m.k_proj, m.v_proj])
            if fused is not None:
                m.qkv_proj = fused
                del m.q_proj, m.k_proj, m.v_proj
                n += 1
        elif isinstance(m, MLP):
            fused = concat_linears([m.gate_proj, m.up_proj])
            if fused is not None:
                m.gate_up_proj = fused
                del m.gate_proj, m.up_proj
                n += 1
    return n


class FusedAttention(Attention):
    """`Attention` with RoPE applied in place by one C call for q and one for k, and, in a block with a
    `qkv_proj` (`fuse_projections`), q, k and v from one matmul; everything else (q/k norms, the attention
    callable, o_proj) is the model's own `forward`."""

    lib: CpuKernels

    def project(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if "qkv_proj" not in self._modules:
            return super().project(x_BTD)
        B, T, _ = x_BTD.shape
        N, K, H = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.qkv_proj(x_BTD).split([N * H, K * H, K * H], dim=-1)
        # views of the projection's rows: RoPE, the K/V write and prefill attention read them where they lie
        # (`lmf_rope_f32_strided`, `lmf_write_kv_f32_bf16_strided`); a path without that copies them itself
        return q.view(B, T, N, H), k.view(B, T, K, H), v.view(B, T, K, H)

    @classmethod
    def wrap(cls, attn: Attention, lib: CpuKernels) -> FusedAttention:
        fused = cls.__new__(cls)
        fused.__dict__.update(attn.__dict__)  # the same projections and norms, not copies
        fused.lib = lib
        return fused

    def rope(self, q_BTNH, k_BTKH, cos_BTH, sin_BTH) -> tuple[torch.Tensor, torch.Tensor]:
        cos_BTH, sin_BTH = cos_BTH.contiguous(), sin_BTH.contiguous()
        rows, threads = q_BTNH.shape[0] * q_BTNH.shape[1], torch.get_num_threads()
        strided = self.lib.rope_f32_strided if q_BTNH.dtype == torch.float32 else None
        if strided is not None and all(t.shape[0] == 1 and token_rows(t[0]) for t in (q_BTNH, k_BTKH)):
            for t, heads in ((q_BTNH, self.n_heads), (k_BTKH, self.n_kv_heads)):  # in place, in the q/k/v rows
                strided(t.data_ptr(), t.stride(1), cos_BTH.data_ptr(), sin_BTH.data_ptr(), rows, heads, self.head_dim,
                        threads)
            return q_BTNH, k_BTKH
        q_BTNH, k_BTKH = q_BTNH.contiguous(), k_BTKH.contiguous()  # views of the q/k/v rows: copied here
        rope = _kernel(self.lib, "rope", q_BTNH.dtype)
        for t, heads in ((q_BTNH, self.n_heads), (k_BTKH, self.n_kv_heads)):  # in place: nothing else holds them
            rope(t.data_ptr(), cos_BTH.data_ptr(), sin_BTH.data_ptr(), rows, heads, self.head_dim, threads)
        return q_BTNH, k_BTKH


class FusedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with the middle as one C call (and gate/up as one matmul when the MLP
    has a `gate_up_proj`)."""

    def __init__(self, mlp: MLP, lib: CpuKernels):
        super().__init__()
        if "gate_up_proj" in mlp._modules:
            self.gate_up_proj = mlp.gate_up_proj
        else:
            self.gate_proj, self.up_proj = mlp.gate_proj, mlp.up_proj
        self.down_proj, self.lib = mlp.down_proj, lib

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        if "gate_up_proj" in self._modules:
            gu = self.gate_up_proj(x_BTD).contiguous()
            if isinstance(self.down_proj, QmmLinear):  # the middle where the down projection prepares its inputs
                out = self.down_proj.forward_swiglu(gu, getattr(self.lib, "gemm_bf16_swiglu", None))
                if out is not None:
                    return out
            rows, half = _kernel(self.lib, "silu_mul_rows", gu.dtype), gu.shape[-1] // 2
            if rows is not None:  # the fused output as it is, each row [gate | up]: no copy of its halves
                h = torch.empty(*gu.shape[:-1], half, dtype=gu.dtype)
                rows(gu.data_ptr(), h.data_ptr(), gu.numel() // (2 * half), half, torch.get_num_threads())
                return self.down_proj(h)
            g, u = gu[..., :half].contiguous(), gu[..., half:].contiguous()  # an older revision's library (A/B)
        else:
            g, u = self.gate_proj(x_BTD).contiguous(), self.up_proj(x_BTD).contiguous()
        h = torch.empty_like(g)
        _kernel(self.lib, "silu_mul", g.dtype)(g.data_ptr(), u.data_ptr(), h.data_ptr(), g.numel())
        return self.down_proj(h)


def fuse_elementwise(model: nn.Module, lib: CpuKernels) -> int:
    """Swap every RMSNorm, Attention and MLP of a bfloat16 or float32 model for its fused stand-in; returns
    how many were swapped. Attention blocks whose head size the RoPE kernel does not take stay as they are."""
    todo = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, RMSNorm) and child.weight.dtype in (torch.bfloat16, torch.float32):
                todo.append((parent, name, FusedRMSNorm))
            elif (isinstance(child, Attention) and not isinstance(child, FusedAttention)
                  and child.head_dim % 2 == 0 and child.head_dim <= MAX_H):
                todo.append((parent, name, FusedAttention))
            elif isinstance(child, MLP):
                todo.append((parent, name, FusedMLP))
    for parent, name, cls in reversed(todo):  # children first: a block's stand-in takes its fused norms
        make = cls.wrap if cls is FusedAttention else cls
        setattr(parent, name, make(getattr(parent, name), lib))
    return len(todo)
