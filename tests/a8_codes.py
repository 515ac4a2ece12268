"""Helpers the int8-activation kernel tests share: int4 codes packed as the kernels store them, and activations in
the order the int4 bodies read them."""

from __future__ import annotations

import numpy as np


def pack4(c_NK: np.ndarray) -> np.ndarray:
    """int4 codes (N, K) in [-8, 7] -> the kernels' packing (N, K/2): low nibble = even k, code + 8."""
    u = (c_NK + 8).astype(np.uint8)
    return np.ascontiguousarray(u[:, 0::2] | (u[:, 1::2] << 4))


def nibble_order(q_MK: np.ndarray) -> np.ndarray:
    """Activations as the int4 body reads them: each block of 32 as its even k, then its odd k."""
    M, K = q_MK.shape
    b = q_MK.reshape(M, K // 32, 32)
    return np.ascontiguousarray(np.concatenate([b[..., 0::2], b[..., 1::2]], -1).reshape(M, K))
