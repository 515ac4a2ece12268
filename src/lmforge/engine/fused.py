"""Engine-only stand-ins for a loaded model's RMSNorm, attention block and MLP that run their
elementwise work through the compiled CPU kernels (`lmforge.engine.kernels`), bfloat16 or float32 (the `_f32` bodies, for CPUs without native bf16).

Why: at a decode step's few rows, each torch op costs microseconds of dispatch whatever its size,
and at a 2,048-token prefill chunk the bf16 elementwise ops (RoPE's four products and the cat,
RMSNorm's float32 round trip, silu then multiply) took more time than the linear layers. One C call
replaces 8 ops for an RMSNorm, ~14 for RoPE on q and k, 2 for SwiGLU's middle. Each kernel rounds
as the torch ops it replaces, so the outputs stay within float32 summation-order noise of the torch
path (`tests/test_engine_kernels.py`).

The model's own modules (`lmforge.model.transformer`) stay plain: the model runner swaps these in
after loading, as it swaps `PackedLinear` in for `nn.Linear`. The swapped model is inference-only.
"""

from __future__ import annotations

import torch
from torch import nn

from lmforge.model.transformer import MLP, Attention, RMSNorm

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
        self.fn(x.data_ptr(), self.weight.data_ptr(), out.data_ptr(), x.numel() // D, D, self.variance_epsilon)
        return out


class FusedAttention(Attention):
    """`Attention` with RoPE applied in place by one C call for q and one for k; everything else
    (projections, q/k norms, the attention callable) is the model's own `forward`."""

    lib: CpuKernels

    @classmethod
    def wrap(cls, attn: Attention, lib: CpuKernels) -> FusedAttention:
        fused = cls.__new__(cls)
        fused.__dict__.update(attn.__dict__)  # the same projections and norms, not copies
        fused.lib = lib
        return fused

    def rope(self, q_BTNH, k_BTKH, cos_BTH, sin_BTH) -> tuple[torch.Tensor, torch.Tensor]:
        q_BTNH, k_BTKH = q_BTNH.contiguous(), k_BTKH.contiguous()  # fresh projections: no copy
        cos_BTH, sin_BTH = cos_BTH.contiguous(), sin_BTH.contiguous()
        rows = q_BTNH.shape[0] * q_BTNH.shape[1]
        rope = _kernel(self.lib, "rope", q_BTNH.dtype)
        for t, heads in ((q_BTNH, self.n_heads), (k_BTKH, self.n_kv_heads)):  # in place: nothing else holds them
            rope(t.data_ptr(), cos_BTH.data_ptr(), sin_BTH.data_ptr(), rows, heads, self.head_dim)
        return q_BTNH, k_BTKH


class FusedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with the middle as one C call."""

    def __init__(self, mlp: MLP, lib: CpuKernels):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.lib = mlp.gate_proj, mlp.up_proj, mlp.down_proj, lib

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
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
