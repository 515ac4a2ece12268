"""GGUF block types as lmforge's group codes: integer codes, a float32 scale and (where the type has a
minimum) a float32 zero per group, with nothing requantized.

Each unpacker takes a tensor's blocks as stored ((rows, bytes a row) uint8, a view of the file map) and
returns `GroupCodes`: codes (N, K) int8, scale (N, G) float32, zero (N, G) float32 or None, and the
`QuantScheme` saying how to read them. The dequantized weight is `scale * code (+ zero)`, one float32
multiply and one add, the same operations `gguf.quants.dequantize` (llama.cpp's reference) performs,
on the same float32 values, so it equals llama.cpp's dequantization **bit for bit** for every type
here (`tests/test_quant_gguf.py` checks each on random blocks):

| type  | bits a weight | lmforge form                                  | code            |
| ----- | ------------- | --------------------------------------------- | --------------- |
| Q8_0  | 8.5           | int8, groups of 32, symmetric                 | as stored       |
| Q4_0  | 4.5           | int4, groups of 32, symmetric                 | nibble - 8      |
| Q4_1  | 5             | int4, groups of 32, zero = m                  | nibble (0..15)  |
| Q5_0  | 5.5           | 5-bit in int8, groups of 32, symmetric        | 5 bits - 16     |
| Q5_1  | 6             | 5-bit in int8, groups of 32, zero = m         | 5 bits (0..31)  |
| Q4_K  | 4.5           | int4, groups of 32, scale d*sc, zero -dmin*m  | nibble (0..15)  |
| Q5_K  | 5.5           | 5-bit in int8, groups of 32, as Q4_K          | 5 bits (0..31)  |
| Q6_K  | 6.5625        | 6-bit in int8, groups of 16, scale d*sc       | 6 bits - 32     |

Types with a zero keep unsigned codes (`QuantScheme.zero_point`), so `scale * code + zero` is exactly
llama.cpp's `d * q + m` (Q4_1, Q5_1) and `d1 * q - m1` (K-quants). Other types (Q2_K, Q3_K, IQ*,
TQ*) have no unpacker: the loader dequantizes them with a warning naming the type.

4-bit codes come out packed as lmforge's int4 kernels read them (`scheme.pack_nibbles`: byte i of a row
holds codes 2i and 2i + 1, stored + 8 when symmetric), moved nibble by nibble from the file's blocks
with byte-wide numpy operations and never widened to a byte a code; 5-, 6- and 8-bit codes come out as
int8, one a byte, built in place from the file's bit planes. A 1B Q4_K_M file unpacks in ~1 s this way.
This module knows nothing about files, models or kernels.

Shape legend: N rows (output features), K inputs, B blocks a row, G groups a row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf.constants import GGMLQuantizationType as Q

from .scheme import QuantScheme

QK_K = 256


@dataclass
class GroupCodes:
    codes: np.ndarray  # (N, K) int8, or 4-bit codes packed (N, K / 2) uint8 (`packed`)
    scale: np.ndarray  # (N, G) float32
    zero: np.ndarray | None  # (N, G) float32, or None (symmetric)
    scheme: QuantScheme

    @property
    def packed(self) -> bool:
        return self.codes.dtype == np.uint8

    def int8_codes(self) -> np.ndarray:
        """(N, K) int8: each code as a byte (a packed row's nibbles, less 8 when symmetric)."""
        if not self.packed:
            return self.codes
        N = self.codes.shape[0]
        u = np.stack([self.codes & 0x0F, self.codes >> 4], axis=-1).reshape(N, -1)
        return u.astype(np.int8) if self.scheme.zero_point else u.astype(np.int8) - 8

    def dequantize(self) -> np.ndarray:
        """(N, K) float32: scale * code (+ zero), the reference the tests compare with gguf's."""
        codes = self.int8_codes()
        N, K = codes.shape
        G = self.scale.shape[1]
        w = codes.reshape(N, G, -1).astype(np.float32) * self.scale[..., None]
        if self.zero is not None:
            w = w + self.zero[..., None]
        return w.reshape(N, K)


def _f16(b: np.ndarray) -> np.ndarray:
    """(..., 2) uint8 -> (...) float32 (every f16 is exact in float32)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _blocks(data: np.ndarray, size: int) -> np.ndarray:
    """(N, bytes a row) -> (N, B, size)."""
    N = data.shape[0]
    return data.reshape(N, -1, size)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """(..., 16) bytes -> (..., 32) values: byte j's low nibble at j, its high nibble at j + 16."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """(..., 4) bytes, a little-endian uint32 -> (..., 32) bits, bit j for element j."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")


def _repack32(qs: np.ndarray) -> np.ndarray:
    """A GGUF 4-bit block's 16 bytes (byte j: element j low, j + 16 high) -> lmforge's 16 (byte i: elements
    2i, 2i + 1), nibbles moved as they are: (..., 16) -> (..., 16) uint8."""
    even, odd = qs[..., 0::2], qs[..., 1::2]
    return np.concatenate([(even & 0x0F) | ((odd & 0x0F) << 4), (even >> 4) | (odd & 0xF0)], axis=-1)


def q8_0(data: np.ndarray) -> GroupCodes:
    b = _blocks(data, 34)
    N = b.shape[0]
    return GroupCodes(b[..., 2:].view(np.int8).reshape(N, -1), _f16(b[..., :2]), None, QuantScheme(8, 32))


def q4_0(data: np.ndarray) -> GroupCodes:
    b = _blocks(data, 18)
    N = b.shape[0]  # stored u = code + 8: lmforge's symmetric nibbles as they are
    return GroupCodes(_repack32(b[..., 2:]).reshape(N, -1), _f16(b[..., :2]), None, QuantScheme(4, 32))


def q4_1(data: np.ndarray) -> GroupCodes:
    b = _blocks(data, 20)
    N = b.shape[0]
    return GroupCodes(_repack32(b[..., 4:]).reshape(N, -1), _f16(b[..., :2]), _f16(b[..., 2:4]),
                      QuantScheme(4, 32, zero_point=True))


def q5_0(data: np.ndarray) -> GroupCodes:
    b = _blocks(data, 22)
    N = b.shape[0]
    u = _nibbles32(b[..., 6:]) | (_high_bits32(b[..., 2:6]) << 4)
    u -= 16  # wraps in uint8: the int8 view is the signed code
    return GroupCodes(u.view(np.int8).reshape(N, -1), _f16(b[..., :2]), None, QuantScheme(5, 32))


def q5_1(data: np.ndarray) -> GroupCodes:
    b = _blocks(data, 24)
    N = b.shape[0]
    u = _nibbles32(b[..., 8:]) | (_high_bits32(b[..., 4:8]) << 4)
    return GroupCodes(u.view(np.int8).reshape(N, -1), _f16(b[..., :2]), _f16(b[..., 2:4]),
                      QuantScheme(5, 32, zero_point=True))


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins (llama.cpp's get_scale_min_k4)."""
    s = scales.astype(np.uint8)
    d, m, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (hi & 0x0F) | ((d >> 6) << 4)], axis=-1)
    mn = np.concatenate([m & 0x3F, (hi >> 4) | ((m >> 6) << 4)], axis=-1)
    return sc, mn


def _k_groups(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K super-blocks (N, B, bytes) -> scale, zero (N, B * 8) float32: d * sc and -(dmin * m)."""
    N = b.shape[0]
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    sc, mn = _k_scale_min(b[..., 4:16])
    scale = d * sc.astype(np.float32)
    zero = -(dmin * mn.astype(np.float32))
    return scale.reshape(N, -1), zero.reshape(N, -1)


def _k_low4(qs: np.ndarray) -> np.ndarray:
    """(N, B, 128) -> (N, B, 8, 32): chunk i's 32 low nibbles are sub-block 2i, its high nibbles 2i + 1."""
    c = qs.reshape(*qs.shape[:2], 4, 32)
    out = np.empty((*qs.shape[:2], 4, 2, 32), dtype=np.uint8)
    np.bitwise_and(c, 0x0F, out=out[..., 0, :])
    np.right_shift(c, 4, out=out[..., 1, :])
    return out.reshape(*qs.shape[:2], 8, 32)


def _k_packed4(qs: np.ndarray) -> np.ndarray:
    """Q4_K's 128 bytes a super-block -> lmforge's packed nibbles (N, B, 128) in k order: each 32-byte chunk holds
    sub-block 2i in its low nibbles and 2i + 1 in its high ones, each repacked to (2i, 2i + 1) pairs."""
    c = qs.reshape(*qs.shape[:2], 4, 32)
    even, odd = c[..., 0::2], c[..., 1::2]
    lo = (even & 0x0F) | ((odd & 0x0F) << 4)  # sub-block 2i
    hi = (even >> 4) | (odd & 0xF0)  # sub-block 2i + 1
    return np.stack([lo, hi], axis=3).reshape(*qs.shape[:2], 128)


def q4_k(data: np.ndarray) -> GroupCodes:
    b = _blocks(data, 144)
    N = b.shape[0]
    scale, zero = _k_groups(b)
    return GroupCodes(_k_packed4(b[..., 16:]).reshape(N, -1), scale, zero, QuantScheme(4, 32, zero_point=True))


def q5_k(data: np.ndarray) -> GroupCodes:
    b = _blocks(data, 176)
    N, B = b.shape[:2]
    scale, zero = _k_groups(b)
    u = _k_low4(b[..., 48:])  # (N, B, 8, 32)
    bits = np.unpackbits(b[..., 16:48, None], axis=-1, bitorder="little")  # (N, B, 32, 8): byte i's bit j
    u |= bits.transpose(0, 1, 3, 2) << 4  # sub-block j takes bit j of each of the 32 bytes
    return GroupCodes(u.view(np.int8).reshape(N, -1), scale, zero, QuantScheme(5, 32, zero_point=True))


def q6_k(data: np.ndarray) -> GroupCodes:
    """ql: per half h, 64 bytes: chunks (h, low nibbles of bytes 0-31, 32-63; high nibbles of 0-31, 32-63);
    qh: per half, 32 bytes of 2-bit pairs, pair t for chunk t; code = (ql | qh << 4) - 32, built in uint8."""
    b = _blocks(data, 210)
    N, B = b.shape[:2]
    ql = b[..., :128].reshape(N, B, 2, 2, 32)  # (half, 32-byte run)
    qh = b[..., 128:192].reshape(N, B, 2, 32)
    out = np.empty((N, B, 2, 4, 32), dtype=np.uint8)
    for t in range(4):
        np.right_shift(ql[:, :, :, t % 2], 4 * (t // 2), out=out[:, :, :, t])
        if t < 2:
            out[:, :, :, t] &= 0x0F
        out[:, :, :, t] |= ((qh >> (2 * t)) & 3) << 4
    out -= 32  # wraps in uint8: the int8 view is the signed code
    sc = b[..., 192:208].view(np.int8).astype(np.float32)  # (N, B, 16)
    scale = (_f16(b[..., 208:210])[..., None] * sc).reshape(N, -1)
    return GroupCodes(out.view(np.int8).reshape(N, -1), scale, None, QuantScheme(6, 16))


UNPACK = {Q.Q8_0: q8_0, Q.Q4_0: q4_0, Q.Q4_1: q4_1, Q.Q5_0: q5_0, Q.Q5_1: q5_1, Q.Q4_K: q4_k, Q.Q5_K: q5_k,
          Q.Q6_K: q6_k}
