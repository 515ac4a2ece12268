"""Exact and near-duplicate detection.

Exact: sha256 of the document text as it stands after normalization, boilerplate removal and
PII masking; the first document with a given hash survives.
Near: MinHash over word `ngram`-shingles (lowercased whitespace-separated words, each word's
UTF-8 CRC-32 combined into a 32-bit shingle hash by `hashing.py`; a document shorter than `ngram`
words is one shingle),
indexed by LSH banding at the Jaccard `threshold`. The LSH index uses `threshold - recall_margin`
and candidates are confirmed by the estimated Jaccard of the two signatures at
`threshold - recall_margin / 2`, so pairs at the threshold merge with high recall while band
collisions far below it do not.

The MinHash and the LSH are datasketch's (2.x, scheme `affine32`), re-implemented in numpy so a
run never imports datasketch (whose `lsh` module pulls in scipy: ~1 s per process) nor runs its
band search through `scipy.integrate.quad` (~1 s per index): same permutations from the same
seed, same MurmurHash3 pre-mix, same (bands, rows) choice, so the same signatures and candidates.
`tests/test_data_prepare.py` checks both against datasketch itself.

Documents arrive in input order; the first of a cluster is its survivor and its id is the
cluster id, so the survivor is deterministic for a given input order. Memory: the band tables
plus one `num_perm` x uint32 signature per surviving document. Signatures are computed by
`signatures()` a batch at a time in worker processes; `NearDedup` runs in the main one.
It knows nothing about readers, splits or files.
"""

from __future__ import annotations

import functools
import hashlib
import zlib

import numpy as np

from lmforge.data.config import NearDedupConfig
from lmforge.data.hashing import ngram_hashes, word_hashes

_SHINGLES_PER_BLOCK = 1 << 16  # shingles hashed per permutation at a time: a 256 KiB temporary


def exact_key(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


@functools.lru_cache(maxsize=8)
def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(a, b), each (num_perm,) uint32: datasketch `MinHash(num_perm, seed, scheme="affine32").permutations`."""
    gen = np.random.RandomState(seed)
    a = gen.randint(0, 1 << 31, num_perm, dtype=np.uint32) * np.uint32(2) + np.uint32(1)
    b = gen.randint(0, 1 << 32, num_perm, dtype=np.uint32)
    return a, b


def _fmix32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finalizer, datasketch's pre-mix of every input hash (wrapping uint32)."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def shingle_hashes(text: str, n: int) -> np.ndarray:
    """Distinct 32-bit hashes of the lowercased word n-grams (the whole text when shorter): the
    reference for `signatures`, which computes the same values for many texts at once."""
    wh = word_hashes(text.lower().split())
    grams = ngram_hashes(wh, min(n, len(wh))) if len(wh) else np.zeros(1, np.uint64)
    return np.unique((grams ^ (grams >> np.uint64(32))) & np.uint64(0xFFFFFFFF))


def minhash(hashes: np.ndarray, num_perm: int, seed: int) -> np.ndarray:
    """MinHash signature (num_perm,) uint32 of a non-empty set of 32-bit hashes."""
    return _minhash_segments(hashes.astype(np.uint32), np.array([0, len(hashes)]), num_perm, seed)[0]


def _minhash_segments(h_S: np.ndarray, bounds: np.ndarray, num_perm: int, seed: int) -> np.ndarray:
    """(T, num_perm) uint32: the signature of each segment `h_S[bounds[t]:bounds[t + 1]]` (none empty).

    One permutation at a time over every shingle, reduced per segment: the (shingles,) temporary
    stays in cache, where a (num_perm, shingles) block would not (3x faster, measured)."""
    a_P, b_P = permutations(num_perm, seed)
    sig_PT = np.empty((num_perm, len(bounds) - 1), dtype=np.uint32)
    lo = 0
    while lo < len(bounds) - 1:  # segments lo..hi-1 hold at most _SHINGLES_PER_BLOCK shingles (or hi = lo + 1)
        hi = max(lo + 1, int(np.searchsorted(bounds, bounds[lo] + _SHINGLES_PER_BLOCK, side="right")) - 1)
        h = _fmix32(h_S[bounds[lo]:bounds[hi]])
        starts = bounds[lo:hi] - bounds[lo]
        phv_S = np.empty(len(h), dtype=np.uint32)
        for k in range(num_perm):
            np.multiply(h, a_P[k], out=phv_S)  # wraps mod 2^32
            phv_S += b_P[k]
            sig_PT[k, lo:hi] = np.minimum.reduceat(phv_S, starts)
        lo = hi
    return np.ascontiguousarray(sig_PT.T)


def _crc_table() -> np.ndarray:
    """zlib's CRC-32 table (reflected polynomial 0xEDB88320): the register after one byte."""
    c = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        c = np.where(c & 1, (c >> np.uint32(1)) ^ np.uint32(0xEDB88320), c >> np.uint32(1))
    return c.astype(np.uint32)


_CRC_TABLE = _crc_table()
_CRC_LOOP_BYTES = 16  # longer words (~1.5% of them) take zlib.crc32 one by one: fewer numpy steps per batch


def crc32_spans(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """(W,) uint32 `zlib.crc32(buf[s:e])` of each span, for all spans at once: one table step per
    byte position, over the spans still that long (sorted by length, longest first, so each step
    works on a prefix)."""
    lengths = ends - starts
    out = np.empty(len(starts), dtype=np.uint32)
    long = np.flatnonzero(lengths > _CRC_LOOP_BYTES)
    data = buf.tobytes() if len(long) else b""
    out[long] = [zlib.crc32(data[s:e]) for s, e in zip(starts[long].tolist(), ends[long].tolist())]
    short = np.flatnonzero(lengths <= _CRC_LOOP_BYTES)
    order = short[np.argsort(-lengths[short].astype(np.int8), kind="stable")]  # longest first
    first = starts[order]
    active = len(order) - np.cumsum(np.bincount(lengths[order], minlength=_CRC_LOOP_BYTES + 1))  # longer than k
    crc = np.full(len(order), 0xFFFFFFFF, dtype=np.uint32)
    for k in range(_CRC_LOOP_BYTES):
        a = int(active[k])
        if not a:
            break
        c = crc[:a]
        crc[:a] = _CRC_TABLE.take((c ^ buf[first[:a] + k]) & np.uint32(0xFF)) ^ (c >> np.uint32(8))
    out[order] = ~crc
    return out


_WORD_BYTE = bytes(0 if chr(c).isspace() else 1 for c in range(128)) + bytes([1] * 128)  # str.isspace, ASCII


def word_crcs(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(W,) uint64 CRC-32 of the UTF-8 bytes of each word of each `text.lower().split()`, and (T + 1,)
    the index of each text's first word. ASCII texts are lowercased and split as bytes in numpy;
    any other text is lowercased and split by Python (Unicode case and spaces), its words joined by
    a space, which splits the same way as bytes (UTF-8 puts no ASCII byte inside a character)."""
    encoded = [t.encode("ascii") if t.isascii() else " ".join(t.lower().split()).encode("utf-8") for t in texts]
    offsets = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)) + 1, out=offsets[1:])
    data = (b"\n".join(encoded) + b"\n").lower()  # bytes.lower: A-Z only
    buf = np.frombuffer(data, dtype=np.uint8)
    edges = np.flatnonzero(np.diff(np.frombuffer(data.translate(_WORD_BYTE), dtype=np.int8), prepend=np.int8(0)))
    starts, ends = edges[0::2], edges[1::2]  # the "\n" after each text ends its last word
    return crc32_spans(buf, starts, ends).astype(np.uint64), np.searchsorted(starts, offsets)


def signatures(texts: list[str], cfg: NearDedupConfig) -> list[np.ndarray]:
    """MinHash signature (num_perm uint32) of each text's word shingles, the numpy work done for all
    of them at once.

    A signature is a minimum over shingles, so repeated shingles change nothing and are kept
    (no `np.unique`); the shingles of all texts are one array, reduced per text."""
    n = cfg.ngram
    wh, first = word_crcs(texts)
    lengths = np.diff(first).tolist()
    windows = ngram_hashes(wh, n)  # windows crossing from one text into the next are never used
    parts, start = [], 0
    for k in lengths:
        if k >= n:
            parts.append(windows[start:start + k - n + 1])
        else:  # shorter than n words: one shingle of all of them (of nothing: 0)
            parts.append(ngram_hashes(wh[start:start + k], k) if k else np.zeros(1, dtype=np.uint64))
        start += k
    bounds = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in parts], out=bounds[1:])
    grams = np.concatenate(parts)
    h_S = ((grams ^ (grams >> np.uint64(32))) & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    return list(_minhash_segments(h_S, bounds, cfg.num_perm, cfg.seed))


@functools.lru_cache(maxsize=64)
def lsh_params(threshold: float, num_perm: int, fp_weight: float = 0.5, fn_weight: float = 0.5) -> tuple[int, int]:
    """(bands, rows) minimizing the weighted false positive + false negative areas (datasketch's
    `_optimal_param`). The integrands are polynomials of degree <= num_perm, so a Gauss-Legendre
    rule with num_perm + 1 nodes integrates them exactly (scipy's adaptive `quad` to ~1e-14)."""
    x, w = np.polynomial.legendre.leggauss(num_perm + 1)
    best, opt = float("inf"), (0, 0)
    for b in range(1, num_perm + 1):
        for r in range(1, num_perm // b + 1):
            s_fp = threshold / 2 * (x + 1)  # nodes mapped onto [0, threshold]
            s_fn = threshold + (1 - threshold) / 2 * (x + 1)  # ... and onto [threshold, 1]
            fp = threshold / 2 * np.dot(w, 1 - (1 - s_fp ** r) ** b)
            fn = (1 - threshold) / 2 * np.dot(w, (1 - s_fn ** r) ** b)
            error = fp * fp_weight + fn * fn_weight
            if error < best:
                best, opt = error, (b, r)
    return opt


class NearDedup:
    """Sequential MinHash LSH: `add(key, sig)` returns the survivor key it duplicates, or None."""

    def __init__(self, cfg: NearDedupConfig):
        self.cfg = cfg
        # MinHash estimates a Jaccard of 0.8 with a std of ~0.035 at 128 permutations, and LSH
        # banding at the threshold itself finds only about half of the pairs sitting right on it.
        # Index at threshold - margin and confirm at threshold - margin / 2, so pairs at or above
        # the threshold are merged with high recall (measured in tests/test_data_prepare.py).
        self.confirm = cfg.threshold - cfg.recall_margin / 2
        self.bands, self.rows = lsh_params(max(0.05, cfg.threshold - cfg.recall_margin), cfg.num_perm)
        self.tables: list[dict[bytes, list[str]]] = [{} for _ in range(self.bands)]
        self.signatures: dict[str, np.ndarray] = {}

    def band_keys(self, sig: np.ndarray) -> list[bytes]:
        """The LSH table keys of a signature: its `bands` slices of `rows` values, as bytes."""
        r = self.rows
        return [sig[i * r:(i + 1) * r].tobytes() for i in range(self.bands)]

    def add(self, key: str, sig: np.ndarray) -> tuple[str | None, float]:
        bands = self.band_keys(sig)
        candidates = {other for table, band in zip(self.tables, bands) for other in table.get(band, ())}
        best, best_sim = None, 0.0
        for other in sorted(candidates):  # sorted: the same survivor whatever set order
            sim = float(np.mean(self.signatures[other] == sig))
            if sim >= self.confirm and (sim > best_sim or best is None):
                best, best_sim = other, sim
        if best is not None:
            return best, best_sim
        for table, band in zip(self.tables, bands):
            table.setdefault(band, []).append(key)
        self.signatures[key] = sig
        return None, 0.0
