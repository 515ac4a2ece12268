"""Assign a document to train, val or test by a hash of its cluster id.

`u = int(sha256(f"{seed}:{cluster_id}")[:8 bytes]) / 2**64` is uniform in [0, 1):
`u < val` -> val, `u < val + test` -> test, else train. Every member of a near-duplicate
cluster has the same cluster id, so clusters never straddle splits, and the assignment is
deterministic and independent of worker count and input order. Knows nothing else.
"""

from __future__ import annotations

import hashlib

from lmforge.data.config import SplitConfig

SPLITS = ("train", "val", "test")


def assign_split(cluster_id: str, cfg: SplitConfig) -> str:
    digest = hashlib.sha256(f"{cfg.seed}:{cluster_id}".encode("utf-8")).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    if u < cfg.val:
        return "val"
    if u < cfg.val + cfg.test:
        return "test"
    return "train"
