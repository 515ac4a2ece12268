"""GPTQ and AWQ int4/int8 checkpoints (AutoGPTQ / GPTQModel / AutoAWQ layouts), read into the same
`QuantizedLinear` state a compressed-tensors folder loads into, where their layout maps onto ours:
symmetric codes, one scale per group of input columns (or per output channel), groups in order.

GPTQ (`quant_method: gptq`), per quantized linear `P` with N outputs, K inputs, G groups:
  * `P.qweight` int32 (K * bits / 32, N): codes packed along K, element i of a word at bits i*bits;
  * `P.qzeros`  int32 (G, N * bits / 32): zero points packed along N the same way; the original
    format (`checkpoint_format: gptq`, "v1") stores zero - 1, `gptq_v2` the zero itself;
  * `P.scales`  (G, N) float16;  `P.g_idx` int32 (K,): each input column's group.
  w[n, k] = (q[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n].

AWQ (`quant_method: awq`, `version: gemm`): `P.qweight` int32 (K, N / 8) and `P.qzeros` int32 (G, N / 8)
packed along N in AutoAWQ's interleaved order (word slot i holds column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]),
`P.scales` (G, N); same formula, no g_idx.

What maps: zero points equal to the midpoint 2^(bits-1) everywhere (GPTQ `sym: true`, AWQ only when
its zeros happen to be 8) and g_idx = k // group_size (no `desc_act` reordering): then the signed code
is q - 2^(bits-1) and the scale is ours transposed. Anything else is refused naming the field or the
tensor: asymmetric zero points would need a fifth bit per code in our kernels' symmetric form.
This module knows nothing about the engine or kernels.

Shape legend: N output features, K input features, G groups, W packed words.
"""

from __future__ import annotations

from typing import Any

import torch

from lmforge.model.config import UnsupportedConfigError

from .scheme import QuantScheme

STORED = ("qweight", "qzeros", "scales", "g_idx")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: slot i of a word holds column AWQ_ORDER[i]


def _refuse(field: str, value: Any, why: str) -> None:
    raise UnsupportedConfigError(f"quantization_config.{field}", value, why)


def read_scheme(hf: dict) -> tuple[QuantScheme, str]:
    """(scheme, layout) for a GPTQ or AWQ `quantization_config`; layout is gptq, gptq_v2 or awq."""
    qc = hf["quantization_config"]
    method = qc.get("quant_method")
    bits = qc.get("bits", qc.get("w_bit"))
    gs = qc.get("group_size", qc.get("q_group_size"))
    if method == "gptq":
        if bits not in (4, 8):
            _refuse("bits", bits, "4- or 8-bit GPTQ only (2/3-bit codes have no kernel here)")
        if qc.get("desc_act"):
            _refuse("desc_act", True, "activation-order GPTQ (a g_idx that reorders the input columns) is not "
                    "implemented; use a checkpoint quantized with desc_act: false")
        if qc.get("sym") is False:
            _refuse("sym", False, "asymmetric GPTQ (zero points other than the midpoint) does not map onto "
                    "lmforge's symmetric int kernels; requantize with `lmforge quantize`")
        fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
        if fmt not in ("gptq", "gptq_v2"):
            _refuse("checkpoint_format", fmt, "gptq or gptq_v2 only (marlin/bitblas repacks are GPU layouts)")
        layout = fmt
    elif method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            _refuse("version", qc.get("version"), "only AutoAWQ's GEMM packing is implemented")
        if bits != 4:
            _refuse("bits", bits, "AWQ checkpoints are 4-bit")
        layout = "awq"
    else:
        raise ValueError(f"not a GPTQ/AWQ config: quant_method {method!r}")
    if gs in (-1, None):
        if bits == 4:
            _refuse("group_size", gs, "4-bit codes need groups (per-channel int4 has no kernel here)")
        group = None
    elif isinstance(gs, int) and gs > 0 and gs % 8 == 0:
        group = gs
    else:
        _refuse("group_size", gs, "a positive multiple of 8 (128 is usual), or -1 for per-channel int8")
    if bits == 8 and group is not None:
        _refuse("group_size", gs, "8-bit codes run per output channel here (group_size -1)")
    return QuantScheme(bits, group), layout


def quantized_modules(keys: set[str]) -> list[str]:
    """The linears a GPTQ/AWQ checkpoint stores quantized: those with a `qweight`."""
    return sorted(k[: -len(".qweight")] for k in keys if k.endswith(".qweight"))


def _unpack(words: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 words -> unsigned codes, unpacked along `dim` (0: rows, 1: columns)."""
    per, mask = 32 // bits, (1 << bits) - 1
    slots = [(words >> (i * bits)) & mask for i in range(per)]  # arithmetic shift, then masked
    if order is not None:  # slot i holds position order[i] within its word's group of `per`
        inverse = [order.index(j) for j in range(per)]
        slots = [slots[i] for i in inverse]
    u = torch.stack(slots, dim=dim + 1)  # (.., W, per, ..) along dim
    shape = list(words.shape)
    shape[dim] *= per
    return u.reshape(shape)


def convert(tensors: dict[str, torch.Tensor], modules: list[str], scheme: QuantScheme, layout: str,
            where: str) -> dict[str, torch.Tensor]:
    """Stored GPTQ/AWQ tensors -> our module state (`qweight` int8 codes (N, K), `weight_scale` (N, G))."""
    quantized = set(modules)
    out = {k: v for k, v in tensors.items()
           if k.rpartition(".")[2] not in STORED or k.rpartition(".")[0] not in quantized}
    bits, mid = scheme.num_bits, 1 << (scheme.num_bits - 1)
    for m in modules:
        need = ("qweight", "qzeros", "scales")
        missing = [s for s in need if f"{m}.{s}" not in tensors]
        if missing:
            raise ValueError(f"{where}: quantized module {m} lacks {', '.join(missing)}; the folder does not "
                             "match its quantization_config")
        scales_GN = tensors[f"{m}.scales"]
        G, N = scales_GN.shape
        if layout == "awq":
            u_KN = _unpack(tensors[f"{m}.qweight"], bits, 1, AWQ_ORDER)
            z_GN = _unpack(tensors[f"{m}.qzeros"], bits, 1, AWQ_ORDER)
        else:
            u_KN = _unpack(tensors[f"{m}.qweight"], bits, 0)
            z_GN = _unpack(tensors[f"{m}.qzeros"], bits, 1) + (1 if layout == "gptq" else 0)
        K = u_KN.shape[0]
        if u_KN.shape[1] != N or z_GN.shape[1] < N:
            raise ValueError(f"{where}: {m}.qweight / qzeros do not match {m}.scales {tuple(scales_GN.shape)}")
        z_GN = z_GN[:, :N]
        if not bool((z_GN == mid).all()):
            bad = int((z_GN != mid).sum())
            raise UnsupportedConfigError(f"{m}.qzeros", f"{bad} of {z_GN.numel()} zero points != {mid}",
                                         "asymmetric zero points do not map onto lmforge's symmetric int kernels; "
                                         "requantize the float model with `lmforge quantize`")
        expect_G = 1 if scheme.group_size is None else K // scheme.group_size
        if G != expect_G:
            raise ValueError(f"{where}: {m}.scales has {G} groups; {K} inputs at group size "
                             f"{scheme.group_size} make {expect_G}")
        if f"{m}.g_idx" in tensors:
            g_idx = tensors[f"{m}.g_idx"].to(torch.int64)
            want = torch.arange(K) // (scheme.group_size or K)
            if g_idx.shape != (K,) or not bool((g_idx == want).all()):
                raise UnsupportedConfigError(f"{m}.g_idx", "a reordering of the input columns",
                                             "activation-order (desc_act) GPTQ is not implemented")
        out[f"{m}.qweight"] = (u_KN.t() - mid).to(torch.int8).contiguous()
        out[f"{m}.weight_scale"] = scales_GN.t().contiguous()
    return out


# ---- writers (tests, and converting our own folders for tools that only read GPTQ) -------------------

def _pack(u: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    per = 32 // bits
    shape = list(u.shape)
    shape[dim] //= per
    u = u.to(torch.int32).reshape(*u.shape[:dim], -1, per, *u.shape[dim + 1:])
    words = torch.zeros(shape, dtype=torch.int32)
    for i in range(per):
        j = order[i] if order is not None else i
        words |= u.select(dim + 1, j) << (i * bits)
    return words


def gptq_tensors(prefix: str, q_NK: torch.Tensor, scale_NG: torch.Tensor, scheme: QuantScheme,
                 layout: str = "gptq") -> dict[str, torch.Tensor]:
    """Our symmetric codes and scales in the GPTQ (v1 / v2) or AWQ layout: the inverse of `convert`."""
    bits, mid = scheme.num_bits, 1 << (scheme.num_bits - 1)
    N, K = q_NK.shape
    G = scale_NG.shape[1]
    u_KN = (q_NK.to(torch.int32) + mid).t().contiguous()
    z_GN = torch.full((G, N), mid, dtype=torch.int32)
    if layout == "awq":
        return {f"{prefix}.qweight": _pack(u_KN, bits, 1, AWQ_ORDER),
                f"{prefix}.qzeros": _pack(z_GN, bits, 1, AWQ_ORDER),
                f"{prefix}.scales": scale_NG.t().to(torch.float16).contiguous()}
    stored_z = z_GN - (1 if layout == "gptq" else 0)
    return {f"{prefix}.qweight": _pack(u_KN, bits, 0), f"{prefix}.qzeros": _pack(stored_z, bits, 1),
            f"{prefix}.scales": scale_NG.t().to(torch.float16).contiguous(),
            f"{prefix}.g_idx": (torch.arange(K) // (scheme.group_size or K)).to(torch.int32)}
