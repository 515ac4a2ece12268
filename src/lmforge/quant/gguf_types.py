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

from .scheme import QuantScheme, pack_lohi, unpack_lohi

QK_K = 256


@dataclass
class GroupCodes:
    """Codes, and scales and zeros as the file stores them: float16 (N, G) a block (Q8_0, Q4_*, Q5_0, Q5_1), or
    int8 (N, G) under a float16 super-block scale (`scale_super` (N, G / per): the K-quants' 6-bit scales under d,
    their minimums under -dmin). `scale_f32()` / `zero_f32()` are the float32 values, exact."""

    codes: np.ndarray  # (N, K) int8, or 4-bit codes packed (N, K / 2) uint8 (`packed`)
    scale: np.ndarray  # (N, G) float16, or int8 under scale_super
    zero: np.ndarray | None  # (N, G) as scale, or None (symmetric)
    scheme: QuantScheme
    scale_super: np.ndarray | None = None  # (N, G / per) float16
    zero_super: np.ndarray | None = None

    @property
    def packed(self) -> bool:
        return self.codes.dtype == np.uint8

    @property
    def per(self) -> int | None:
        """Groups a super-block scale covers (two-level scales), or None."""
        return None if self.scale_super is None else self.scale.shape[1] // self.scale_super.shape[1]

    def _widen(self, q: np.ndarray | None, sup: np.ndarray | None) -> np.ndarray | None:
        if q is None:
            return None
        if sup is None:
            return q.astype(np.float32)
        return np.repeat(sup.astype(np.float32), self.per, axis=1) * q.astype(np.float32)

    def scale_f32(self) -> np.ndarray:
        return self._widen(self.scale, self.scale_super)

    def zero_f32(self) -> np.ndarray | None:
        return self._widen(self.zero, self.zero_super)

    def int8_codes(self) -> np.ndarray:
        """(N, K) int8: each code as a byte (a packed row's codes, less the offset when symmetric)."""
        if not self.packed:
            return self.codes
        N, bits = self.codes.shape[0], self.scheme.num_bits
        if bits == 4:
            u = np.stack([self.codes & 0x0F, self.codes >> 4], axis=-1).reshape(N, -1)
        else:
            u = unpack_lohi(self.codes, bits, self.codes.shape[1] * 8 // bits)
        return u.astype(np.int8) if self.scheme.zero_point else u.astype(np.int8) - self.scheme.code_offset

    def dequantize(self) -> np.ndarray:
        """(N, K) float32: scale * code (+ zero), the reference the tests compare with gguf's."""
        codes, scale, zero = self.int8_codes(), self.scale_f32(), self.zero_f32()
        N, K = codes.shape
        G = scale.shape[1]
        w = codes.reshape(N, G, -1).astype(np.float32) * scale[..., None]
        if zero is not None:
            w = w + zero[..., None]
        return w.reshape(N, K)


def _f16(b: np.ndarray) -> np.ndarray:
    """(..., 2) uint8 -> (...) float16, the stored value."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


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
    u = _nibbles32(b[..., 6:]) | (_high_bits32(b[..., 2:6]) << 4)  # stored u = code + 16: the kernels' own
    return GroupCodes(pack_lohi(u.reshape(N, -1), 5), _f16(b[..., :2]), None, QuantScheme(5, 32))


def q5_1(data: np.ndarray) -> GroupCodes:
    b = _blocks(data, 24)
    N = b.shape[0]
    u = _nibbles32(b[..., 8:]) | (_high_bits32(b[..., 4:8]) << 4)
    return GroupCodes(pack_lohi(u.reshape(N, -1), 5), _f16(b[..., :2]), _f16(b[..., 2:4]),
                      QuantScheme(5, 32, zero_point=True))


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins (llama.cpp's get_scale_min_k4)."""
    s = scales.astype(np.uint8)
    d, m, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (hi & 0x0F) | ((d >> 6) << 4)], axis=-1)
    mn = np.concatenate([m & 0x3F, (hi >> 4) | ((m >> 6) << 4)], axis=-1)
    return sc, mn


def _k_groups(b: np.ndarray) -> dict:
    """Q4_K / Q5_K super-blocks (N, B, bytes) -> the scales sc (N, B * 8) int8 under d (N, B) and the zeros m under
    -dmin: scale = d * sc, zero = -dmin * m = -(dmin * m), exact in float32 as gguf computes them."""
    N = b.shape[0]
    sc, mn = _k_scale_min(b[..., 4:16])
    return dict(scale=sc.reshape(N, -1).view(np.int8), scale_super=_f16(b[..., 0:2]),
                zero=mn.reshape(N, -1).view(np.int8), zero_super=-_f16(b[..., 2:4]))


def _k_low4(qs: np.ndarray) -> np.ndarray:
    """(N, B, 128) -> (N, B, 8, 32): chunk i's 32 low nibbles are sub-block 2i, its high nibbles 2i + 1."""
    c = qs.reshape(*qs.shape[:2], 4, 32)
    out = np.empty((*qs.shape[:2], 4, 2, 32), dtype=np.uint8)
    np.bitwise_and(c, 0x0F, out=out[..., 0, :])
    np.right_shift(c, 4, out=out[..., 1, :])
    return out.reshape(*qs.shape[:2], 8, 32)


def _k_packed4(qs: np.ndarray) -> np.ndarray:
    """Q4_K's 128 bytes a super-block -> lmforge's packed nibbles (N, B, 128) in k order: each 32-byte chunk holds
    sub-block 2i in its low nibbles and 2i + 1 in its high ones, each repacked to (2i, 2i + 1) pairs. Byte pairs
    (even, odd) are read as one little-endian uint16 w: the low sub-block's byte is w's nibbles 0 and 2, the high
    one's nibbles 1 and 3 (contiguous uint16 operations, 4x the strided byte ones)."""
    N, B = qs.shape[:2]
    w = np.ascontiguousarray(qs).view("<u2").reshape(N, B, 4, 16)
    out = np.empty((N, B, 4, 2, 16), dtype=np.uint8)
    out[..., 0, :] = (w & 0x000F) | ((w >> 4) & 0x00F0)  # sub-block 2i: even's low nibble, odd's low nibble
    out[..., 1, :] = ((w >> 4) & 0x000F) | ((w >> 8) & 0x00F0)  # sub-block 2i + 1: the high nibbles
    return out.reshape(N, B, 128)


def q4_k(data: np.ndarray) -> GroupCodes:
    b = _blocks(data, 144)
    N = b.shape[0]
    return GroupCodes(_k_packed4(b[..., 16:]).reshape(N, -1), scheme=QuantScheme(4, 32, zero_point=True),
                      **_k_groups(b))


def q5_k(data: np.ndarray) -> GroupCodes:
    b = _blocks(data, 176)
    N, B = b.shape[:2]
    u = _k_low4(b[..., 48:])  # (N, B, 8, 32)
    bits = np.unpackbits(b[..., 16:48, None], axis=-1, bitorder="little")  # (N, B, 32, 8): byte i's bit j
    u |= bits.transpose(0, 1, 3, 2) << 4  # sub-block j takes bit j of each of the 32 bytes
    return GroupCodes(pack_lohi(u.reshape(N, -1), 5), scheme=QuantScheme(5, 32, zero_point=True), **_k_groups(b))


def q6_k(data: np.ndarray) -> GroupCodes:
    """ql: per half h, 64 bytes: chunks (h, low nibbles of bytes 0-31, 32-63; high nibbles of 0-31, 32-63);
    qh: per half, 32 bytes of 2-bit pairs, pair t for chunk t; the stored u = ql | qh << 4 (code + 32), built eight
    bytes at a time in uint64 with byte-wise masks, then packed at 6 bits (`pack_lohi`)."""
    b = _blocks(data, 210)
    N, B = b.shape[:2]
    ql = np.ascontiguousarray(b[..., :128]).view("<u8").reshape(N, B, 2, 2, 4)  # (half, 32-byte run, 8 bytes)
    qh = np.ascontiguousarray(b[..., 128:192]).view("<u8").reshape(N, B, 2, 4)
    out = np.empty((N, B, 2, 4, 4), dtype=np.uint64)
    lo4, two = np.uint64(0x0F0F0F0F0F0F0F0F), np.uint64(0x0303030303030303)
    for t in range(4):
        v = (ql[:, :, :, t % 2] >> np.uint64(4 * (t // 2))) & lo4
        v |= ((qh >> np.uint64(2 * t)) & two) << np.uint64(4)
        out[:, :, :, t] = v
    sc = b[..., 192:208].view(np.int8).reshape(N, -1)  # (N, B * 16) under d (N, B)
    return GroupCodes(pack_lohi(out.view(np.uint8).reshape(N, -1), 6), sc, None, QuantScheme(6, 16),
                      scale_super=_f16(b[..., 208:210]))


UNPACK = {Q.Q8_0: q8_0, Q.Q4_0: q4_0, Q.Q4_1: q4_1, Q.Q5_0: q5_0, Q.Q5_1: q5_1, Q.Q4_K: q4_k, Q.Q5_K: q5_k,
          Q.Q6_K: q6_k}


def q8_0_rows(data: np.ndarray) -> np.ndarray:
    """(n, bytes a row) Q8_0 rows as float32 (n, K) in a few numpy operations: d * code, the products `q8_0`'s
    `dequantize` makes, so the same bits. For an embedding lookup of a few tokens, where the unpacker's ~25 operations
    cost ~0.2 ms of a decode step (the interpreter's caches cold after the layers' weights went through)."""
    b = _blocks(data, 34)
    return (b[..., 2:].view(np.int8).astype(np.float32) * _f16(b[..., :2]).astype(np.float32)[..., None]).reshape(
        b.shape[0], -1)


def q4_0_rows(data: np.ndarray) -> np.ndarray:
    """As `q8_0_rows`, Q4_0 (byte j of a block: element j in its low nibble, j + 16 in its high one; code nibble - 8)."""
    b = _blocks(data, 18)
    w = np.empty((b.shape[0], b.shape[1], 32), np.float32)
    np.subtract(b[..., 2:] & 0x0F, 8, out=w[..., :16], dtype=np.float32)
    np.subtract(b[..., 2:] >> 4, 8, out=w[..., 16:], dtype=np.float32)
    w *= _f16(b[..., :2]).astype(np.float32)[..., None]
    return w.reshape(b.shape[0], -1)


ROWS_F32 = {Q.Q8_0: q8_0_rows, Q.Q4_0: q4_0_rows}  # block types with a direct float32 row lookup
