"""Weight-only quantization schemes and their math: symmetric round-to-nearest (RTN) per output
channel (int8) or per group of input columns (int4), and the dense int32 packing of the
compressed-tensors `pack-quantized` format.

Conventions follow compressed-tensors (so a folder we write dequantizes to the same numbers in
`transformers` and vLLM): scale = absmax / ((qmax - qmin) / 2), i.e. absmax / 127.5 for int8 and
absmax / 7.5 for int4; q = clamp(round(w / scale), qmin, qmax); w' = q * scale. Packing stores
element i of a row at bits [i*b, (i+1)*b) of the row's int32 words, as the unsigned value q - qmin.
This module knows nothing about files, models or kernels.

Shape legend: N output features, K input features, G groups per row (K / group size), W packed
int32 words per row.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

SCHEME_NAMES = ("w8a16", "w4a16")


@dataclass(frozen=True)
class QuantScheme:
    """`num_bits` 8 or 4 (what lmforge writes); 5 and 6 (GGUF's Q5_*, Q6_K, held in int8) come from GGUF
    files. `zero_point`: the codes are unsigned (0 .. 2^bits - 1) and each group has a float zero, w =
    scale * code + zero (GGUF's Q4_1, Q5_1, Q4_K, Q5_K: llama.cpp's `d * q + m`); else symmetric signed
    codes, w = scale * code."""

    num_bits: int  # 8 or 4; 5 or 6 from GGUF files (stored one code a byte)
    group_size: int | None  # None: one scale per output channel
    zero_point: bool = False

    @property
    def name(self) -> str:
        return f"w{self.num_bits}a16" + ("-zp" if self.zero_point else "")

    @property
    def storage_bits(self) -> int:
        """Bits a code takes in the kernels' layout: 4, 5, 6 (`pack_lohi`) or 8."""
        return self.num_bits

    @property
    def code_offset(self) -> int:
        """What a stored unsigned 4/5/6-bit code exceeds the signed symmetric code by (2^(bits - 1); 0 for int8)."""
        return 1 << (self.num_bits - 1) if self.num_bits < 8 else 0

    @property
    def qmin(self) -> int:
        return -(1 << (self.num_bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.num_bits - 1)) - 1

    @property
    def strategy(self) -> str:
        return "channel" if self.group_size is None else "group"

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size is None else in_features // self.group_size

    def check_shape(self, name: str, in_features: int) -> None:
        if self.group_size is not None and in_features % self.group_size:
            raise ValueError(f"{name}: {in_features} input features are not a multiple of group size "
                             f"{self.group_size}; pass --group-size that divides it (e.g. 32)")

    @classmethod
    def from_name(cls, name: str, group_size: int | None = 128) -> QuantScheme:
        """w8a16: int8, one scale per output channel; w4a16: int4, one scale per `group_size` inputs."""
        if name == "w8a16":
            return cls(8, None)
        if name == "w4a16":
            if not group_size or group_size < 8 or group_size % 8:
                raise ValueError(f"--group-size {group_size}: w4a16 needs a positive multiple of 8 (128 is usual)")
            return cls(4, group_size)
        raise ValueError(f"unknown scheme {name!r}; use one of {', '.join(SCHEME_NAMES)}")


def compute_scales(w_NK: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype) -> torch.Tensor:
    """Symmetric scales (N, G) in `scale_dtype`; an all-zero group gets the dtype's eps (no division by 0)."""
    N, K = w_NK.shape
    absmax_NG = w_NK.float().reshape(N, scheme.groups(K), -1).abs().amax(-1)
    scale_NG = (absmax_NG / ((scheme.qmax - scheme.qmin) / 2)).to(scale_dtype)
    return scale_NG.masked_fill(scale_NG == 0, torch.finfo(scale_dtype).eps)


def quantize(w_NK: torch.Tensor, scale_NG: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """int8 codes (N, K) in [qmin, qmax] for given scales (the stored, already-rounded ones)."""
    N, K = w_NK.shape
    G = scale_NG.shape[1]
    q_NGk = torch.round(w_NK.float().reshape(N, G, -1) / scale_NG.float()[..., None])
    return q_NGk.clamp_(scheme.qmin, scheme.qmax).reshape(N, K).to(torch.int8)


def quantize_rtn(w_NK: torch.Tensor, scheme: QuantScheme,
                 scale_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest: (codes int8 (N, K), scales (N, G))."""
    scheme.check_shape("weight", w_NK.shape[1])
    scale_NG = compute_scales(w_NK, scheme, scale_dtype)
    return quantize(w_NK, scale_NG, scheme), scale_NG


def dequantize(q_NK: torch.Tensor, scale_NG: torch.Tensor, dtype: torch.dtype = torch.float32,
               zero_NG: torch.Tensor | None = None) -> torch.Tensor:
    """q * scale (+ zero) in float32, then cast to `dtype`: the reference every kernel is checked against."""
    w_NK = scale_groups_(q_NK.float(), scale_NG)
    if zero_NG is not None:
        N = w_NK.shape[0]
        w_NK.view(N, zero_NG.shape[1], -1).add_(zero_NG.float()[..., None])
    return w_NK.to(dtype)


def scale_groups_(w_NK: torch.Tensor, scale_NG: torch.Tensor) -> torch.Tensor:
    """In place: each group of K/G consecutive codes of a row times its scale (G = 1: per channel)."""
    N = w_NK.shape[0]
    w_NK.view(N, scale_NG.shape[1], -1).mul_(scale_NG.to(w_NK.dtype)[..., None])
    return w_NK


_scratch = threading.local()


def scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable buffer of `numel` elements, one per (thread, dtype, device, inference mode), grown on
    demand: where a weight is rebuilt for one matmul at a time (dequantize + sgemm for big batches, a
    light LoRA base), every layer rebuilds into the same memory instead of allocating a weight each call. Valid
    until the same thread asks again; per thread, so two engines stepping in two threads of one
    process never write into each other's weight."""
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = {}
    # a tensor made under inference_mode (the engine) cannot be written outside it (training): one each
    key = (dtype, device, torch.is_inference_mode_enabled())
    buf = bufs.get(key)
    if buf is None or buf.numel() < numel:
        buf = bufs[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def pack_nibbles(u_NK: torch.Tensor) -> torch.Tensor:
    """lmforge's int4 kernel layout: (N, K) stored nibbles (0..15: a symmetric code + 8, or a zero-point code as it
    is) -> (N, K / 2) uint8, byte i = nibble 2i | nibble 2i + 1 << 4."""
    u = u_NK.to(torch.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()


def unpack_nibbles(p_NW: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_nibbles`: (N, K / 2) uint8 -> (N, K) uint8 stored nibbles."""
    return torch.stack([p_NW & 0x0F, p_NW >> 4], dim=-1).reshape(p_NW.shape[0], -1)


def pack_lohi(u_NK: torch.Tensor | np.ndarray, bits: int) -> torch.Tensor | np.ndarray:
    """The kernels' 5- and 6-bit layout (engine/kernels/common.h): (N, K) unsigned codes -> (N, K * bits / 8) uint8:
    each block of 32 as 16 + 4 hb bytes (hb = bits - 4): its low four bits (byte i: element i low nibble, i + 16
    high), then its high bits, element e's at byte 16 + e % (4 hb), bits hb * (e / (4 hb)). A tensor in, a tensor
    out; an array in, an array out (the GGUF loader's numpy)."""
    if isinstance(u_NK, torch.Tensor):
        return torch.from_numpy(pack_lohi(u_NK.to(torch.uint8).numpy(), bits))
    u = np.ascontiguousarray(u_NK, dtype=np.uint8)
    N, K = u.shape
    hb, per = bits - 4, 4 * (bits - 4)
    b = u.reshape(N, K // 32, 32)
    low = (b[..., :16] & 0x0F) | ((b[..., 16:] & 0x0F) << 4)  # (N, B, 16)
    high = (b >> 4).reshape(N, K // 32, 32 // per, per)  # element e = q * per + j at [q, j]
    plane = np.zeros((N, K // 32, per), dtype=np.uint8)
    for q in range(32 // per):
        plane |= high[:, :, q] << (hb * q)
    return np.concatenate([low, plane], axis=2).reshape(N, -1)


def unpack_lohi(p_NW: torch.Tensor | np.ndarray, bits: int, K: int) -> torch.Tensor | np.ndarray:
    """Inverse of `pack_lohi`: (N, K * bits / 8) uint8 -> (N, K) uint8 unsigned codes."""
    if isinstance(p_NW, torch.Tensor):
        return torch.from_numpy(unpack_lohi(p_NW.numpy(), bits, K))
    N = p_NW.shape[0]
    hb, per = bits - 4, 4 * (bits - 4)
    blocks = p_NW.reshape(N, K // 32, 16 + per)
    low, plane = blocks[..., :16], blocks[..., 16:]
    high = np.stack([(plane >> (hb * q)) & ((1 << hb) - 1) for q in range(32 // per)], axis=2).reshape(N, K // 32, 32)
    lo = np.concatenate([low & 0x0F, low >> 4], axis=2)
    return (lo | (high << 4)).reshape(N, K)


def pack_int32(q_NK: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Dense packing along K: 32 / num_bits codes per int32 word, element i at bits i*num_bits, stored
    unsigned (q - qmin); a ragged last word is zero-padded. (N, K) int8 -> (N, W) int32."""
    per = 32 // num_bits
    N, K = q_NK.shape
    u_NK = q_NK.to(torch.int32) + (1 << (num_bits - 1))
    pad = -K % per
    if pad:
        u_NK = torch.nn.functional.pad(u_NK, (0, pad))
    u_NWp = u_NK.reshape(N, -1, per)
    packed_NW = torch.zeros(u_NWp.shape[:2], dtype=torch.int32, device=q_NK.device)
    for i in range(per):  # int32 shifts wrap at bit 31, which is exactly the two's-complement word we want
        packed_NW |= u_NWp[:, :, i] << (i * num_bits)
    return packed_NW


def unpack_int32_into(packed_NW: torch.Tensor, num_bits: int, out_NK: torch.Tensor) -> torch.Tensor:
    """`unpack_int32` written into a float tensor (N, K) with K a multiple of 32 / num_bits, one word
    plane at a time through a `scratch` int32 plane: no allocation."""
    per, mask = 32 // num_bits, (1 << num_bits) - 1
    N = out_NK.shape[0]
    out_NWp = out_NK.view(N, -1, per)
    plane_NW = scratch(packed_NW.numel(), torch.int32, packed_NW.device).view_as(packed_NW)
    for i in range(per):
        torch.bitwise_right_shift(packed_NW, i * num_bits, out=plane_NW)
        out_NWp[:, :, i].copy_(plane_NW.bitwise_and_(mask))
    return out_NK.sub_(1 << (num_bits - 1))


def unpack_int32(packed_NW: torch.Tensor, num_bits: int, in_features: int) -> torch.Tensor:
    """Inverse of `pack_int32`: (N, W) int32 -> (N, K) int8 codes."""
    per, mask = 32 // num_bits, (1 << num_bits) - 1
    parts = [(packed_NW >> (i * num_bits)) & mask for i in range(per)]  # arithmetic shift, then masked
    u_NK = torch.stack(parts, dim=-1).reshape(packed_NW.shape[0], -1)[:, :in_features]
    return (u_NK - (1 << (num_bits - 1))).to(torch.int8)
