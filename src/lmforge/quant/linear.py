"""Quantized linear layers: the stored form a quantized checkpoint loads into, and the linear
backends the engine swaps in once at start (one backend per model, chosen by `select_backend`).

  * `QuantizedLinear` — codes (N, K) int8 and scales (N, G) as loaded; its forward dequantizes on
    every call (slow, obviously right: the reference for the others, and what training sees).
  * `DequantLinear` — the weight dequantized once into the activation dtype, then `F.linear`: the
    same math as a plain model holding the dequantized weights (so greedy tokens are identical),
    and the CUDA path (cuBLAS on a dense weight; no memory saved at run time, said in the docs).
  * `Int8Linear` — CPU: `torch.ops.aten._weight_int8pack_mm` (per-channel int8, reads 1 byte a weight).
  * `Int4Linear` — CPU: `torch.ops.aten._weight_int4pack_mm_for_cpu` (group-wise int4, half a byte).

`QmmLinear` runs lmforge's own compiled kernels on CPU: `lmf_qmm_f32` (A16: float32 activations,
exact dequantized math; the default) or, with `quant_activations="int8"`, `lmf_qmm_a8` (A8: each
token's activations quantized to int8 on the fly, int32 integer dot products with AVX-512 VNNI /
AVX-VNNI / AVX2 / portable bodies; an approximation, as llama.cpp's Q8_0 activations are).

torch's CPU kernels run on bfloat16 activations: torch's float32 bodies of both ops are ~10x slower
than the bf16 ones on an AVX2 machine at one row (3.2 ms vs 0.28 ms for 4864x896, measured with
`python -m lmforge.bench.quant --linears`), so a float32 model casts its activations to bf16
around the call. This module knows nothing about checkpoints or scheduling.

Shape legend: M rows, N output features, K input features, G groups per row.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from .scheme import (QuantScheme, dequantize, pack_lohi, pack_nibbles, scale_groups_, scratch, unpack_lohi,
                     unpack_nibbles)


class QuantizedLinear(nn.Module):
    """Codes (N, K) int8 (or 4-bit `packed` (N, K / 2) uint8) and per-group scales (N, G) in a float dtype, with
    zeros (`scheme.zero_point`). `scale_per` (GGUF's K-quants): the scales are int8 (N, G) under a float16 per
    `scale_per` groups (`weight_scale_super`, (N, G / scale_per)), as the file stores them; `scales()` is the
    float32 product, exact. Zeros take the scales' form."""

    def __init__(self, in_features: int, out_features: int, scheme: QuantScheme, bias: bool = False,
                 scale_dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                 packed: bool = False, scale_per: int | None = None):
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        if packed and scheme.num_bits not in (4, 5, 6):
            raise ValueError(f"packed codes are 4-, 5- or 6-bit; {scheme.name} holds one code a byte")
        shape, dtype = ((out_features, in_features * scheme.num_bits // 8), torch.uint8) if packed else \
            ((out_features, in_features), torch.int8)
        self.register_buffer("qweight", torch.zeros(shape, dtype=dtype, device=device))
        G = scheme.groups(in_features)
        kinds = ("scale", "zero") if scheme.zero_point else ("scale",)
        for kind in kinds:  # unsigned codes with a zero: w = scale * code + zero (GGUF's Q4_1, Q5_1, K-quants)
            fill = torch.ones if kind == "scale" else torch.zeros
            self.register_buffer(f"weight_{kind}", fill(out_features, G, dtype=torch.int8 if scale_per else scale_dtype,
                                                        device=device))
            if scale_per:
                self.register_buffer(f"weight_{kind}_super", torch.ones(out_features, G // scale_per,
                                                                        dtype=torch.float16, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False) if bias else None

    @property
    def scale_per(self) -> int | None:
        """Groups under one super-block scale (two-level scales), or None (one float scale a group)."""
        sup = getattr(self, "weight_scale_super", None)
        return None if sup is None else self.weight_scale.shape[1] // sup.shape[1]

    def _widen(self, kind: str, idx: torch.Tensor | None = None) -> torch.Tensor | None:
        t = getattr(self, f"weight_{kind}", None)
        if t is None:
            return None
        per = self.scale_per
        t = t if idx is None else t[idx]
        if per is None:
            return t
        sup = getattr(self, f"weight_{kind}_super")
        sup = (sup if idx is None else sup[idx]).float().repeat_interleave(per, dim=1)
        return sup * t.float()

    def scales(self) -> torch.Tensor:
        """(N, G) per-group scales as float (two-level ones widened: exact in float32)."""
        return self._widen("scale")

    def zeros(self) -> torch.Tensor | None:
        return self._widen("zero")

    @property
    def packed(self) -> bool:
        """4-, 5- or 6-bit codes held as the kernels read them (`pack_nibbles`, `pack_lohi`: (N, K * bits / 8)
        uint8, the GGUF loader's form, no int8 copy), not one int8 code a weight."""
        return self.qweight.dtype == torch.uint8

    def codes(self) -> torch.Tensor:
        """(N, K) int8 codes: symmetric signed codes, or a zero-point layer's unsigned ones."""
        return self._codes(self.qweight)

    def _codes(self, qweight: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return qweight
        bits = self.scheme.num_bits
        u = unpack_nibbles(qweight) if bits == 4 else unpack_lohi(qweight, bits, self.in_features)
        return (u if self.scheme.zero_point else u.to(torch.int16) - self.scheme.code_offset).to(torch.int8)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.codes(), self.scales(), dtype, self.zeros())

    def rows(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(codes (R, K) int8, scales (R, G) float, zeros or None) of rows `idx` only (an embedding lookup)."""
        return self._codes(self.qweight[idx]), self._widen("scale", idx), self._widen("zero", idx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight(x.dtype), b)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.scheme.name}, group_size={self.scheme.group_size}"


class QuantizedEmbedding(nn.Module):
    """A token embedding kept as the codes a GGUF file stores it in (`gguf_types`), in a `QuantizedLinear`'s form:
    a lookup dequantizes only the rows it reads (scale * code + zero, the file's values bit for bit), so the table
    costs its file size, not a float copy (SmolLM2-135M's Q8_0 table: 30 MB instead of 113 MB in float32; a
    128k-token vocabulary of width 2,048: 0.3 GB instead of 1 GB). A tied LM head is the same `QuantizedLinear`:
    the table is stored once. Engine only: training and `lmforge convert` load the float table."""

    def __init__(self, table: QuantizedLinear, dtype: torch.dtype, owns: bool = True):
        super().__init__()
        self.table, self.dtype = [table], dtype  # a list: a tied head owns it (`owns` False), counted there
        if owns:  # its tensors, so that a model's bytes count them (not saved: the loader builds them)
            for name, t in table.named_buffers():
                self.register_buffer(name, t, persistent=False)
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.table[0].rows(ids.reshape(-1))
        return dequantize(*rows[:2], self.dtype, rows[2]).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, codes"


class DequantLinear(nn.Module):
    name = "dequantize + matmul"

    def __init__(self, q: QuantizedLinear, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight", q.dequantized_weight(dtype), persistent=False)
        self.bias = None if q.bias is None else q.bias.detach().to(dtype)

    @staticmethod
    def supports(q: QuantizedLinear, device: torch.device) -> bool:
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _Bf16Kernel(nn.Module):
    """Casts activations to bf16 around a CPU weight-only kernel and adds the bias after it."""

    def __init__(self, q: QuantizedLinear):
        super().__init__()
        self.bias = None if q.bias is None else q.bias.detach().to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_MK = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out_MN = self.matmul(x_MK)
        if self.bias is not None:
            out_MN = out_MN + self.bias
        return out_MN.to(x.dtype).reshape(*x.shape[:-1], -1)


class Int8Linear(_Bf16Kernel):
    name = "int8 weight-only (torch _weight_int8pack_mm)"

    def __init__(self, q: QuantizedLinear, dtype: torch.dtype):
        super().__init__(q)
        self.register_buffer("qweight", q.codes().contiguous(), persistent=False)  # (N, K) int8
        self.register_buffer("scale", q.scales()[:, 0].to(torch.bfloat16).contiguous(), persistent=False)

    @staticmethod
    def supports(q: QuantizedLinear, device: torch.device) -> bool:
        return (device.type == "cpu" and q.scheme.num_bits == 8 and q.scheme.group_size is None
                and not q.scheme.zero_point)

    def matmul(self, x_MK: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x_MK, self.qweight, self.scale)


class Int4Linear(_Bf16Kernel):
    """torch's CPU int4 layout: unsigned codes (q + 8) reordered by `_convert_weight_to_int4pack_for_cpu`,
    and (G, N, 2) scales-and-zeros with w = (u - 8) * scale + zero; symmetric, so zero = 0."""

    name = "int4 weight-only (torch _weight_int4pack_mm_for_cpu)"

    def __init__(self, q: QuantizedLinear, dtype: torch.dtype):
        super().__init__(q)
        u_NK = q.codes().to(torch.int32) + 8
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(u_NK, 1), persistent=False)
        s_GN = q.scales().t().to(torch.bfloat16)
        self.register_buffer("scale_zeros", torch.stack([s_GN, torch.zeros_like(s_GN)], -1).contiguous(),
                             persistent=False)
        self.group_size = q.scheme.group_size

    @staticmethod
    def supports(q: QuantizedLinear, device: torch.device) -> bool:
        gs = q.scheme.group_size
        return (device.type == "cpu" and q.scheme.num_bits == 4 and gs in (32, 64, 128, 256)
                and q.in_features % gs == 0 and q.in_features % 2 == 0 and not q.scheme.zero_point)

    def matmul(self, x_MK: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x_MK, self.packed, self.group_size, self.scale_zeros)


def _kernel_layout(q: QuantizedLinear) -> bool:
    """Whether lmforge's kernels take the layer's codes: int8 per channel; 8-, 6-, 5- or 4-bit codes in groups that
    are a multiple of 32, with or without zero offsets; 8- or 6-bit in symmetric groups of 16 (GGUF's Q6_K)."""
    gs, zp, bits = q.scheme.group_size, q.scheme.zero_point, q.scheme.storage_bits
    if gs is None:
        return bits == 8 and not zp
    if q.in_features % gs or q.in_features % 32:
        return False
    return gs % 32 == 0 or (gs == 16 and bits in (8, 6) and not zp)


def _kernel_threads() -> int:
    return int(os.environ.get("LMFORGE_QMM_THREADS", 0)) or torch.get_num_threads()


class QmmLinear(nn.Module):
    """CPU, float32 activations (CPUs without bf16): the compiled `lmf_qmm_f32` for a decode step's few
    rows, reading 1 (int8) or 0.5 (int4, packed here two codes a byte) bytes a weight. From `GEMM_MIN_ROWS` rows the
    work is compute: with `c_gemm` (the build has `lmf_gemm_f32`'s AVX2 + FMA body) `lmf_qmm_f32` hands
    every such call to that panel GEMM, which dequantizes the weight 16 rows at a time into L2 (the same
    float32 weights as `dequantized`, so the same products up to summation order); without, above
    `MAX_ROWS` rows the weight is dequantized into a float32 buffer shared by every layer and MKL's sgemm
    runs (no float32 copy is kept; 1.1-1.5x slower than the panel GEMM from 64 rows on the 300M's shapes).

    With `a8` (the engine's `quant_activations="int8"`: a callable over `lmf_qmm_a8`'s arguments
    with the ISA bound, its `.isa` naming the body), up to `A8_MAX_ROWS` rows of float32 or bfloat16
    activations (`A8_PREFILL_ROWS` with neither `prefill_bf16` nor `c_gemm`) go through the int8-activation
    kernel instead, on the same packed codes; above that, with `c_gemm`, the panel GEMM on float32
    activations (AVX2 EPYC, int8 / int4 g32, the 300M's shapes, 2 threads: 120-126 GFLOP/s at 128 rows
    against 102-117 for A8, 132-153 against 110-121 at 256); and
    (a prefill chunk), with `prefill_bf16` (a CPU with bf16 units), the weight is dequantized into
    bfloat16 and oneDNN's bf16 GEMM runs on bf16-rounded activations, no less exact than int8 ones
    (prefill of 512 tokens on the random 300M Q8_0, 2 threads, Zen 4: 368 tok/s, against 200 for
    dequantize + sgemm, the exact path; `python scripts/vs_llamacpp.py`)."""

    name = "int8/int4 weight-only (lmforge lmf_qmm_f32, float32 activations)"
    MAX_ROWS = 32  # measured on the AVX2 EPYC (8192x2048, 1 thread): the kernel beats dequantize + sgemm up to 32 rows
    A8_MAX_ROWS = 64  # the decode batches issue 25 targets (and the C decoder layer's limit)
    # with `c_gemm`, from this many rows (by bits) `lmf_qmm_f32` runs the panel GEMM, not its row kernel: where
    # the two cross on the AVX2 EPYC (the 300M's 96 layer linears, 2 threads, int8/int4 g32; rows / GEMM time
    # at 8, 10, 12 rows: int8 0.92, 1.05, 1.20; int4 0.85-0.87, 1.06-1.13, 1.17-1.20; float32 0.87, 1.12,
    # 1.24; bf16, whose row kernel reads half float32's bytes, 0.95-0.98 at 20 rows and 1.08-1.14 at 24)
    GEMM_MIN_ROWS = {32: 10, 16: 22, 8: 10, 6: 10, 5: 10, 4: 10}
    # without bf16 units, prefill chunks up to this many rows stay on the A8 kernel too: on the AVX2 EPYC
    # (2 threads, int8 / int4 g32, 1024x2816 and back) it runs 93-131 GFLOP/s at 128 rows where dequantize
    # + sgemm runs 67-82, and sgemm wins only from ~512 rows (116-129 against 84-100;
    # `python scripts/cpu_rows_bench.py --linear`)
    A8_PREFILL_ROWS = 256
    # with bf16 units, A8 prefill chunks up to this many rows stay on the A8 kernel, above it the bf16 GEMM on the
    # dequantized weight (whose dequantization costs each call): Zen 4, random 300M Q4_0, 2 threads, one prompt
    # (A8 to 64 / to 256 rows): 100 tokens 484-487 / 320-325 ms, 128 496-539 / 422-442, 160 589-594 / 533-586,
    # 200 640-666 / 629-809, 256 744-823 / 881-943
    A8_BF16_PREFILL_ROWS = 160
    # bf16 weights on a CPU with bf16 units (`from_bf16(..., bf16_units=True)`): from this many rows oneDNN's bf16
    # GEMM on the CPU's bf16 units (activations rounded to bf16), below it the exact float32 row kernel. Zen 4,
    # the 300M's 96 layer linears read from memory, 2 threads, row kernel / bf16 GEMM time: 1 row 0.70, 2 rows
    # 0.69, 4 rows 0.91, 8 rows 1.30, 16 rows 1.63, 64 rows 1.74
    BF16_UNITS_ROWS = 6

    def __init__(self, q: QuantizedLinear, dtype: torch.dtype, qmm=None, a8=None, prefill_bf16: bool = False,
                 c_gemm: bool = False):
        super().__init__()
        self.qmm, self.a8, self.bits = qmm, a8, q.scheme.storage_bits
        # the A8 kernel's panel GEMM (AVX-512 VNNI) takes every row count from its threshold: 2-3x the row bodies at
        # 64-256 rows (`lmforge bench linear`), prefill 1.7-1.9x in the engine (docs/engine.md, "The A8 panel GEMM")
        self.a8_panel = a8 is not None and getattr(a8, "panel_rows", 0) > 0
        self.prefill_bf16 = prefill_bf16 and a8 is not None and not self.a8_panel
        self.N, self.K = q.out_features, q.in_features
        self.gs = q.scheme.group_size or q.in_features
        codes, zp = q.qweight.contiguous(), q.scheme.zero_point
        if self.bits < 8 and not q.packed:  # unsigned: code + offset (a zero-point code as is), packed as stored
            u = codes if zp else codes.to(torch.int16) + q.scheme.code_offset
            codes = pack_nibbles(u) if self.bits == 4 else pack_lohi(u, self.bits)
        self.register_buffer("codes", codes, persistent=False)
        self._take_scales(q)
        self.bias = None if q.bias is None else q.bias.detach().float()
        self.threads = _kernel_threads()
        self.c_gemm = c_gemm and qmm is not None
        self.bf16_gemm, self.bf16_panel_rows = None, 0  # bf16 weights only (`from_bf16`)

    def _take_scales(self, q: QuantizedLinear) -> None:
        """The scales (and zeros) in the form the layer stores them, which the kernels read as they are (common.h's
        `lmf_scales`): float32; float16 (a GGUF file's block scales and minimums); int8 under a float16 a super-block
        (the K-quants'). `desc` (seven int64: form, groups a super-block, four addresses, the layout) is None for
        float32 scales without zeros in rows: the kernels' plain float32 argument, as before these forms."""
        per, s, z = q.scale_per, q.weight_scale, getattr(q, "weight_zero", None)
        if per is None and s.dtype not in (torch.float32, torch.float16):  # bf16 scales: widened once (exact)
            s, z = s.float(), None if z is None else z.float()
        form = 2 if per else 1 if s.dtype == torch.float16 else 0
        sup = lambda kind: getattr(q, f"weight_{kind}_super").contiguous() if per else None  # noqa: E731
        self.register_buffer("scale", s.contiguous(), persistent=False)  # (N, G)
        self.register_buffer("scale_super", sup("scale"), persistent=False)  # (N, G / per) float16, or None
        self.register_buffer("zero", None if z is None else z.contiguous(), persistent=False)
        self.register_buffer("zero_super", sup("zero") if z is not None else None, persistent=False)
        self.layout = 0
        self._describe(form, per or 1)

    def _describe(self, form: int, per: int) -> None:
        """`desc` from the stored tensors: form, groups a super-block, four addresses, the layout (common.h)."""
        parts = (self.scale, self.scale_super, self.zero, self.zero_super)
        self.desc = None if form == 0 and self.zero is None and self.layout == 0 else torch.tensor(
            [form, per, *(0 if t is None else t.data_ptr() for t in parts), self.layout], dtype=torch.int64)

    def redescribe(self) -> None:
        """`desc` again after the stored tensors moved (`engine.hugepages`): the same form, their new addresses."""
        if self.desc is not None:
            self._describe(int(self.desc[0]), int(self.desc[1]))

    PANEL = 16  # weight rows a stored panel (common.h's LMF_PANELS16)

    def store_panels(self, int8: bool = False) -> bool:
        """Keep the codes and their scales as 16-row panels (common.h's LMF_PANELS16): 16 weight rows' 4-byte words
        side by side, the panel GEMMs' own interleave, so that no call rebuilds it. Same bytes, moved; `dequantized`
        reads them back. False (nothing changed) where it does not apply (`_panels_apply`). int8 codes only with
        `int8` (the engine passes it by default, `store_layer_panels`)."""
        if not (self._panels_apply(int8) and self.N % self.PANEL == 0 and self.layout == 0
                and self.codes.device.type == "cpu"):
            return False
        P, two_level = self.PANEL, self.scale_super is not None
        words = self.codes.shape[1] * self.codes.element_size() // 4  # 4-byte words a row: K / 8 (int4), K / 4, K / 2
        self.codes = self.codes.view(self.N // P, P, words, -1).transpose(1, 2).contiguous().view(self.N, -1)
        panels = lambda t: t.view(self.N // P, P, -1).transpose(1, 2).contiguous().view(self.N, -1)  # noqa: E731
        for name in ("scale", "scale_super", "zero", "zero_super"):
            if getattr(self, name) is not None:
                setattr(self, name, panels(getattr(self, name)))
        self.layout = P
        form = 2 if two_level else 1 if self.scale.dtype == torch.float16 else 0
        self._describe(form, self.scale.shape[1] // self.scale_super.shape[1] if two_level else 1)
        return True

    def _panels_apply(self, int8: bool) -> bool:
        """Whether the bodies that read stored panels run every call of this layer, on its form:
        - int4 codes (zero offsets or none; float32, float16 or two-level scales: Q4_0, Q4_1, Q4_K, w4a16) or int8 codes
          (none; one-level scales: Q8_0, w8a16), where the A8 panel bodies run (an AVX-512 VNNI CPU): a decode step's
          few rows take `a8_lanes_avx512vnni` (qmm_a8_panel.c), prefill skips the panel's per-call transpose;
        - bf16 weights (one word the input pair k, k + 1 of a row; the scale, one float32 a row, stays as it lies),
          where this layer's many rows run the bf16 panel GEMM (`bf16_panel_rows`, AVX512-BF16): it no longer builds
          them every call (a 16-row decode batch of the 300M spent 30% of its time there), and fewer rows take
          `bf16_lanes_f32` (gemm_bf16.c) on float32 activations."""
        if self.bits == 16:
            return bool(self.bf16_panel_rows) and self.K % 32 == 0 and self.zero is None
        two_level = self.scale_super is not None  # the K-quants' int8 scales under a float16 a super-block (int4 only)
        return (self.a8_panel and self.bits in ((4, 8) if int8 else (4,)) and (not two_level or self.bits == 4)
                and self.scale.dtype in ((torch.int8,) if two_level else (torch.float32, torch.float16))
                and (self.zero is None or (self.bits == 4 and self.zero.dtype == self.scale.dtype))
                and self.gs % 32 == 0)

    def _row_major(self) -> tuple[torch.Tensor, ...]:
        """(codes, scale, zero, scale_super, zero_super) a weight row after another, whatever the stored layout."""
        parts = (self.scale, self.zero, self.scale_super, self.zero_super)
        if self.layout == 0:
            return (self.codes, *parts)
        P = self.PANEL
        words = self.codes.shape[1] * self.codes.element_size() // 4
        codes = self.codes.view(self.N // P, words, P, -1).transpose(1, 2).reshape(self.N, -1)
        rows = lambda t: None if t is None else t.view(self.N // P, -1, P).transpose(1, 2).reshape(self.N, -1)  # noqa: E731
        return (codes, *(rows(t) for t in parts))

    @property
    def desc_ptr(self) -> int | None:
        """The scales' descriptor for the kernels' trailing argument (None: NULL, the float32 `scale`)."""
        return None if self.desc is None else self.desc.data_ptr()

    def float_scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scales (N, G), zeros (N, G) or None) in float32, two-level ones widened (exact)."""
        def widen(t, sup):
            if t is None:
                return None
            return t.float() if sup is None else sup.float().repeat_interleave(t.shape[1] // sup.shape[1], 1) * t
        _, scale, zero, scale_super, zero_super = self._row_major()
        return widen(scale, scale_super), widen(zero, zero_super)

    @classmethod
    def _dense(cls, linear: nn.Linear, qmm, dtype: torch.dtype, bits: int) -> "QmmLinear":
        """A dense `nn.Linear`'s weight as the kernel's codes, scale 1 per row (`from_bf16`, `from_f32`)."""
        w = linear.weight.detach()
        if w.dtype != dtype or w.device.type != "cpu":
            name = "bf16" if bits == 16 else "f32"
            want = str(dtype).removeprefix("torch.")
            raise ValueError(f"QmmLinear.from_{name} takes a {want} CPU weight, not {w.dtype} on {w.device}")
        self = cls.__new__(cls)  # no QuantizedLinear to read: the fields are set here
        nn.Module.__init__(self)
        self.qmm, self.a8, self.bits, self.prefill_bf16 = qmm, None, bits, False
        self.c_gemm = self.a8_panel = False
        self.bf16_gemm, self.bf16_panel_rows = None, 0
        self.N, self.K = linear.out_features, linear.in_features
        self.gs = self.K
        codes = w.contiguous()  # bf16: its bits as int16; float32: the weight itself, no copy
        self.register_buffer("codes", codes.view(torch.int16) if bits == 16 else codes, persistent=False)
        self.register_buffer("scale", torch.ones(self.N, 1), persistent=False)
        self.scale_super = self.zero = self.zero_super = self.desc = None
        self.layout = 0
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        self.threads = _kernel_threads()
        return self

    @classmethod
    def from_bf16(cls, linear: nn.Linear, qmm, c_gemm: bool = False, bf16_units: bool = False,
                  bf16_panel: tuple | None = None) -> "QmmLinear":
        """A bfloat16 `nn.Linear` on float32 activations (a bf16 checkpoint under `--dtype auto`):
        the weight stays bf16 (2 bytes read a weight, `lmf_qmm_f32` with bits 16, widened exactly inside
        the kernel), scale 1. Prefill chunks: with `c_gemm` (the build has `lmf_gemm_f32`'s AVX2 body) every
        row count goes to `lmf_qmm_f32`, which from 22 rows runs the panel GEMM (the weight widened 16 rows at
        a time in L2: 1.2-2.5x widen + sgemm on the 300M's shapes); without, above `MAX_ROWS` rows the weight
        is widened into the shared float32 buffer for sgemm. The same numbers as the float32 model of the
        same weights, up to summation order. With `bf16_units` (a CPU with AVX-512 BF16 or AMX), many rows run
        on the CPU's bf16 dot products on the weight as it is (activations rounded to bf16, as a bf16 model's
        are): `bf16_panel` = (`lmf_gemm_bf16`, rows), lmforge's panel GEMM from that many rows (one call, which
        the C decoder layer makes too, so a bf16 decode batch stays in C), else oneDNN's bf16 GEMM from
        `BF16_UNITS_ROWS` rows (1.3-1.8x the float32 kernels from 8 rows on the Zen 4). Fewer rows: the exact
        float32 kernel, which reads the weights faster than torch's bf16 matmul (a batch-1 decode step of the
        random 300M on the Zen 4: 19.5-22.3 ms against 29-37 ms in bf16)."""
        self = cls._dense(linear, qmm, torch.bfloat16, 16)
        self.c_gemm = c_gemm and qmm is not None
        if bf16_units and bf16_panel is not None and self.K % 32 == 0:  # the panel takes inputs 32 at a time
            self.bf16_gemm, self.bf16_panel_rows = bf16_panel
        else:
            self.prefill_bf16 = bf16_units
        return self

    @classmethod
    def from_f32(cls, linear: nn.Linear, qmm, max_rows: int, c_gemm: bool = False) -> "QmmLinear":
        """A float32 `nn.Linear` on `lmf_qmm_f32` with bits 32 (the weights read as they are, scale 1) up to
        `max_rows` rows: what lets a float32 model's decode step run a decoder layer as one C call
        (`engine.decode_layer`). Above, with `c_gemm` every row count stays on `lmf_qmm_f32`, which from 10
        rows runs the panel GEMM `lmf_gemm_f32` (1.1-1.3x oneDNN's on the 300M's shapes, AVX2 EPYC); without,
        oneDNN's GEMM on the same tensor. No copy: `codes` is the weight itself."""
        self = cls._dense(linear, qmm, torch.float32, 32)
        self.MAX_ROWS = max_rows  # this layer's own: the kernel reads a weight row once per 8 rows
        self.c_gemm = c_gemm and qmm is not None
        return self

    @staticmethod
    def supports(q: QuantizedLinear, device: torch.device, dtype: torch.dtype) -> bool:
        gs = q.scheme.group_size
        return (device.type == "cpu" and dtype == torch.float32 and _kernel_layout(q))

    @staticmethod
    def supports_a8(q: QuantizedLinear, device: torch.device, dtype: torch.dtype) -> str | None:
        """None when `lmf_qmm_a8` takes this layer on these activations, else why not."""
        gs, K = q.scheme.group_size, q.in_features
        if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            return f"runs on CPU with float32 or bfloat16 activations, not {device.type} {dtype}"
        if K % 32 or K >= 65536:
            return f"needs in_features a multiple of 32 below 65536, not {K}"
        if not _kernel_layout(q):
            return (f"takes int8 per channel, int8/int4 in groups a multiple of 32, or int8 in groups of 16, not "
                    f"{q.scheme.name} group {gs}")
        return None

    @property
    def bf16_rows(self) -> int:
        """From how many rows this layer runs oneDNN's bf16 GEMM (0: never): with `prefill_bf16`, bf16
        weights from `BF16_UNITS_ROWS`, int8/int4 weights on int8 activations above `A8_BF16_PREFILL_ROWS`."""
        if not self.prefill_bf16:
            return 0
        return self.BF16_UNITS_ROWS if self.bits == 16 else self.A8_BF16_PREFILL_ROWS + 1

    @property
    def gemm_rows(self) -> int:
        """From how many rows `lmf_qmm_f32` hands this layer's calls to the panel GEMM (0: never)."""
        return self.GEMM_MIN_ROWS[self.bits] if self.c_gemm else 0

    def dequantized(self) -> torch.Tensor:
        """The float32 weight (N, K), written into the shared `scratch` buffer."""
        if self.bits == 32:  # the float32 weight itself
            return self.codes
        w_NK = scratch(self.N * self.K, torch.float32, self.codes.device).view(self.N, self.K)
        if self.bits == 16:  # bf16 weights, scale 1: widening is exact
            return w_NK.copy_(self._row_major()[0].view(torch.bfloat16))
        scale, zero = self.float_scales()
        codes = self._row_major()[0]
        if self.bits == 8:
            w_NK.copy_(codes)  # int8 -> float32 in place
        elif self.bits == 4:  # nibbles; a symmetric code is nibble - 8, a zero-point code the nibble itself
            pairs = w_NK.view(self.N, -1, 2)
            pairs[..., 0].copy_(codes & 0x0F)
            pairs[..., 1].copy_(codes >> 4)
            if zero is None:
                w_NK.sub_(8)
        else:  # 5 / 6 bits: the unsigned codes, less the offset when symmetric
            w_NK.copy_(unpack_lohi(codes, self.bits, self.K))
            if zero is None:
                w_NK.sub_(1 << (self.bits - 1))
        scale_groups_(w_NK, scale)
        if zero is not None:
            w_NK.view(self.N, zero.shape[1], -1).add_(zero[..., None])
        return w_NK

    def forward_a8(self, x_MK: torch.Tensor, a8=None) -> torch.Tensor:
        """(M, N) float32 from (M, K) float32 or bfloat16 rows, int8 activations (M <= A8_MAX_ROWS);
        `a8` another body's kernel than the layer's (the benchmark compares them on one weight)."""
        M, a8 = x_MK.shape[0], a8 or self.a8
        out_MN = torch.empty(M, self.N)
        rc = a8(x_MK.data_ptr(), int(x_MK.dtype == torch.float32), self.codes.data_ptr(), self.scale.data_ptr(),
                out_MN.data_ptr(), M, self.N, self.K, self.bits, self.gs, self.threads, self.desc_ptr)
        if rc != 0:
            raise RuntimeError(f"lmf_qmm_a8 ({a8.isa}) refused {self.N}x{self.K} int{self.bits} group {self.gs}")
        return out_MN

    def _a8_takes(self, rows: int) -> bool:
        """Whether `rows` rows run on int8 activations (`forward_a8`)."""
        a8_rows = (self.bf16_rows - 1 if self.prefill_bf16 else self.A8_MAX_ROWS if self.c_gemm
                   else self.A8_PREFILL_ROWS)
        return self.a8 is not None and (rows <= a8_rows or bool(self.a8_panel))

    def forward_swiglu(self, gu: torch.Tensor, fused_bf16=None) -> torch.Tensor | None:
        """This layer on silu(gate) * up of gate_up rows `gu` (..., 2 K) float32 in one call, SwiGLU's middle taken
        where the activations are prepared: on int8 activations by `lmf_qmm_a8` (act 2), on bf16 weights from the
        panel GEMM's rows by `fused_bf16` (`lmf_gemm_bf16_swiglu`); the bits of the middle, then `forward`. None
        elsewhere (the caller runs the middle, then forward)."""
        rows = gu.numel() // (2 * self.K)
        a8 = self._a8_takes(rows)
        if (self.bias is not None or gu.dtype != torch.float32 or not gu.is_contiguous()
                or not (a8 or (fused_bf16 is not None and self.bf16_panel_rows and rows >= self.bf16_panel_rows))):
            return None
        out_MN = torch.empty(rows, self.N)
        if a8:
            rc = self.a8(gu.data_ptr(), 2, self.codes.data_ptr(), self.scale.data_ptr(), out_MN.data_ptr(), rows,
                         self.N, self.K, self.bits, self.gs, self.threads, self.desc_ptr)
        else:
            rc = fused_bf16(gu.data_ptr(), self.codes.data_ptr(), self.scale.data_ptr(), out_MN.data_ptr(), rows,
                            self.N, self.K, self.threads, self.layout)
        return out_MN.reshape(*gu.shape[:-1], self.N) if rc == 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.K
        if self._a8_takes(rows):
            out_MN = self.forward_a8(x.reshape(-1, self.K).contiguous())
            if self.bias is not None:
                out_MN += self.bias
            return out_MN.to(x.dtype).reshape(*x.shape[:-1], self.N)
        if self.bf16_panel_rows and rows >= self.bf16_panel_rows:  # bf16 weights on lmforge's bf16 panel GEMM
            x_MK = x.reshape(-1, self.K).float().contiguous()
            out_MN = torch.empty(rows, self.N)
            rc = self.bf16_gemm(x_MK.data_ptr(), self.codes.data_ptr(), self.scale.data_ptr(), out_MN.data_ptr(), rows,
                                self.N, self.K, self.threads, self.layout)
            if rc != 0:
                raise RuntimeError(f"lmf_gemm_bf16 refused {self.N}x{self.K}")
            if self.bias is not None:
                out_MN += self.bias
            return out_MN.to(x.dtype).reshape(*x.shape[:-1], self.N)
        if self.bf16_rows and rows >= self.bf16_rows:
            if self.bits == 16:  # the bf16 weight as it is
                w_NK = self._row_major()[0].view(torch.bfloat16)
            else:
                w_NK = scratch(self.N * self.K, torch.bfloat16, self.codes.device).view(self.N, self.K)
                w_NK.copy_(self.dequantized())
            out_MN = F.linear(x.reshape(-1, self.K).to(torch.bfloat16), w_NK).float()
            if self.bias is not None:
                out_MN += self.bias
            return out_MN.to(x.dtype).reshape(*x.shape[:-1], self.N)
        x_MK = x.reshape(-1, self.K).float().contiguous()
        M = x_MK.shape[0]
        if M > self.MAX_ROWS and self.bits == 32 and not self.c_gemm and torch.backends.mkldnn.is_available():
            # float32 weights above the kernel's rows (prefill chunks): oneDNN's GEMM on the plain weight, the
            # packed linear's bits and about its speed (sgemm is up to 1.4x slower at 32-512 rows here)
            out_MN = torch.ops.mkldnn._linear_pointwise(x_MK, self.codes, self.bias, "none", [], "")
        elif (M > self.MAX_ROWS and not self.c_gemm) or self.qmm is None:
            out_MN = F.linear(x_MK, self.dequantized(), self.bias)
        else:
            out_MN = torch.empty(M, self.N)
            rc = self.qmm(x_MK.data_ptr(), self.codes.data_ptr(), self.scale.data_ptr(), out_MN.data_ptr(),
                          M, self.N, self.K, self.bits, self.gs, self.threads, self.gemm_rows, self.desc_ptr)
            if rc != 0:
                raise RuntimeError(f"lmf_qmm_f32 refused {self.N}x{self.K} int{self.bits} group {self.gs}")
            if self.bias is not None:
                out_MN += self.bias
        return out_MN.to(x.dtype).reshape(*x.shape[:-1], self.N)


BACKENDS = {"dequant": DequantLinear, "int8": Int8Linear, "int4": Int4Linear, "qmm": QmmLinear}


def quantized_linears(model: nn.Module) -> list[tuple[nn.Module, str, QuantizedLinear]]:
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if isinstance(child, QuantizedLinear)]


QUANT_ACTIVATIONS = ("none", "int8")


def _a8_backend(layers: list[QuantizedLinear], device: torch.device, dtype: torch.dtype, reference: bool,
                qmm, a8, prefill_bf16: bool = False, c_gemm: bool = False) -> functools.partial:
    """`QmmLinear` with int8 activations for every layer, or a ValueError saying why it cannot be."""
    if reference:
        raise ValueError("quant_activations='int8' is an approximation with no reference path: "
                         "use quant_activations='none' with attention='reference'")
    if a8 is None:
        raise ValueError("quant_activations='int8' needs lmforge's compiled CPU kernels on a CPU model in "
                         "float32 or bfloat16 (check `lmforge doctor`: engine cpu kernels; cpu_kernels=True)")
    for q in layers:
        why = QmmLinear.supports_a8(q, device, dtype)
        if why is not None:
            raise ValueError(f"quant_activations='int8': layer {q.extra_repr()}: lmf_qmm_a8 {why}; "
                             "use quant_activations='none'")
    c_gemm = c_gemm and dtype == torch.float32 and qmm is not None and not prefill_bf16
    backend = functools.partial(QmmLinear, qmm=qmm if dtype == torch.float32 else None, a8=a8,
                                prefill_bf16=prefill_bf16, c_gemm=c_gemm)
    panel = getattr(a8, "panel_rows", 0)
    above = (f"from {panel} rows its AVX-512 VNNI panel GEMM" if panel > 0 else
             f"above {QmmLinear.A8_BF16_PREFILL_ROWS} rows bf16 GEMM on dequantized weights" if prefill_bf16 else
             f"above {QmmLinear.A8_MAX_ROWS} rows lmforge lmf_gemm_f32 on float32 activations" if c_gemm else
             f"above {QmmLinear.A8_PREFILL_ROWS} rows sgemm on dequantized weights")
    backend.name = f"int8/int4 weights x int8 activations (lmforge lmf_qmm_a8, {a8.isa}; {above})"  # type: ignore
    return backend


def select_backend(model: nn.Module, device: torch.device, reference: bool = False, qmm=None,
                   quant_activations: str = "none", a8=None, prefill_bf16: bool = False,
                   c_gemm: bool = False) -> type[nn.Module] | functools.partial | None:
    """One backend for the whole model. `quant_activations="int8"`: `QmmLinear` on the compiled
    int8-activation kernel `a8` (a ValueError when it cannot run: no kernels, a layer it does not
    take, reference mode, no quantized layer). Otherwise: float32 activations on CPU with the
    compiled `qmm` kernel: `QmmLinear`; else torch's packed CPU kernel (bf16 activations) when every
    quantized layer fits it; else dequantize + matmul. None when the model holds no quantized layers.
    `c_gemm`: the library has `lmf_gemm_f32`'s body, so prefill rows on float32 activations take it."""
    if quant_activations not in QUANT_ACTIVATIONS:
        raise ValueError(f"quant_activations={quant_activations!r}: must be one of {', '.join(QUANT_ACTIVATIONS)}")
    layers = [q for _, _, q in quantized_linears(model)]
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    if quant_activations == "int8":
        if not layers:
            raise ValueError("quant_activations='int8' applies to int8/int4-weight checkpoints; this model has "
                             "no quantized linear layer (quantize it with `lmforge quantize`)")
        return _a8_backend(layers, device, dtype, reference, qmm, a8, prefill_bf16, c_gemm)
    if not layers:
        return None
    if not reference:
        if qmm is not None and all(QmmLinear.supports(q, device, dtype) for q in layers):
            backend = functools.partial(QmmLinear, qmm=qmm, c_gemm=c_gemm)
            backend.name = QmmLinear.name + ("; prefill on lmforge lmf_gemm_f32" if c_gemm else "")  # type: ignore
            return backend
        for cls in (Int8Linear, Int4Linear):
            if all(cls.supports(q, device) for q in layers):
                return cls
    return DequantLinear


def store_layer_panels(model: nn.Module) -> int:
    """`QmmLinear.store_panels` for every linear of the decoder layers (`model.model.layers`) and the LM head; how
    many took it. Not an LM head whose weight the input embedding shares (a `QuantizedEmbedding` over its codes, or a
    tied bf16 weight): moving it would keep two copies. `LMFORGE_A8_PANELS`: `all` (default) int4 and int8 codes, 1
    int4 codes only, 0 none (the rows layout, to compare); `LMFORGE_BF16_PANELS`: 1 (default) bf16 weights, 0 none.
    int8 codes joined the default when the lanes body's int8 pass was mended: `scripts/vs_openvino.py --precision 8-bit
    --engine lmforge`, `all` against 1 alternating, three pairs (Zen 4, 2026-12-06 17:37-17:44): the batch cell 277.5 /
    268.0 / 281.4 against 248.1 / 264.9 / 265.8 tok/s, one sequence at depth 128 87.0 / 84.0 / 82.1 against 89.5 /
    84.3 / 81.6."""
    backbone = getattr(model, "model", None)
    layers = getattr(backbone, "layers", None)
    which = os.environ.get("LMFORGE_A8_PANELS", "all").strip().lower()
    if which not in ("0", "1", "all"):
        raise ValueError(f"LMFORGE_A8_PANELS={which!r}: all (int4 and int8 weights, the default), 1 (int4) or 0 (none)")
    bf16 = os.environ.get("LMFORGE_BF16_PANELS", "1").strip()
    if bf16 not in ("0", "1"):
        raise ValueError(f"LMFORGE_BF16_PANELS={bf16!r}: 1 (bf16 weights as panels) or 0 (as rows)")
    if layers is None:
        return 0
    mods = [m for m in layers.modules() if isinstance(m, QmmLinear)]
    head, embed = getattr(model, "lm_head", None), getattr(backbone, "embed_tokens", None)
    embed_w = getattr(embed, "weight", None)
    if (isinstance(head, QmmLinear) and not isinstance(embed, QuantizedEmbedding)
            and not (isinstance(embed_w, torch.Tensor) and embed_w.untyped_storage().data_ptr()
                     == head.codes.untyped_storage().data_ptr())):
        mods.append(head)
    take = lambda m: bf16 == "1" if m.bits == 16 else which != "0"  # noqa: E731
    return sum(m.store_panels(int8=which == "all") for m in mods if take(m))


def swap_backend(model: nn.Module, backend, dtype: torch.dtype) -> int:
    """Replace every `QuantizedLinear` by `backend`; returns how many."""
    todo = quantized_linears(model)
    for parent, name, q in todo:
        setattr(parent, name, backend(q, dtype))
    return len(todo)
