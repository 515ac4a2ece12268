"""The KV pool's pages faulted in ahead of use on idle CPU (`kv_pool._prefault`, `madvise(MADV_POPULATE_WRITE)`):
every page of every layer's pools resident once the thread ends, K/V written meanwhile kept as written, no thread
with `LMFORGE_KV_PREFAULT=0`, and the thread ends when the pool is freed."""

from __future__ import annotations

import ctypes
import gc
import os
import sys

import pytest
import torch

from lmforge.engine.attention import KVPool
from lmforge.engine.attention import kv_pool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_POPULATE_WRITE) is Linux's")


def _resident_fraction(t: torch.Tensor) -> float:
    """mincore(2) over the tensor's whole pages: the fraction mapped in."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    n = (end - start) // page
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(start, end - start, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) / n


def _pool(**kw) -> KVPool:  # 2 layers x 2 pools of 12 MB: several prefault chunks each
    return KVPool(2, 768, 16, 8, 64, torch.float32, torch.device("cpu"), store_dtype=torch.bfloat16, **kw)


def test_prefault_maps_every_page_and_keeps_what_requests_wrote(monkeypatch):
    monkeypatch.setenv("LMFORGE_KV_PREFAULT", "1")
    pool = _pool()
    assert pool.prefault is not None
    k, v = torch.randn(1, 40, 8, 64), torch.randn(1, 40, 8, 64)
    slots = torch.arange(5000, 5040)
    pool.write(1, k, v, slots)  # while the thread runs (or after: either way kept)
    pool.prefault.join(timeout=60)
    assert not pool.prefault.is_alive()
    for t in pool.k_pools_PBKH + pool.v_pools_PBKH:
        assert _resident_fraction(t) == 1.0
    k_rows, v_rows = pool.rows(1)
    assert torch.equal(k_rows[slots], k[0].bfloat16()) and torch.equal(v_rows[slots], v[0].bfloat16())
    assert not k_rows[:5000].any()  # the pages it mapped read as the zeros they were


def test_prefault_off_and_its_end_when_the_pool_goes(monkeypatch):
    monkeypatch.setenv("LMFORGE_KV_PREFAULT", "0")
    pool = _pool()
    assert pool.prefault is None
    monkeypatch.setenv("LMFORGE_KV_PREFAULT", "1")
    monkeypatch.setattr(kv_pool, "PREFAULT_CHUNK", 4096)  # many small steps, so it is still running below
    pool = _pool()
    thread = pool.prefault
    del pool
    gc.collect()
    thread.join(timeout=60)
    assert not thread.is_alive()


def test_the_thread_never_holds_a_pool_tensor(monkeypatch):
    """While the thread is inside madvise the engine lets the pool go: its tensors are freed in this thread at
    once, not later in the prefault thread (freeing a torch tensor lets go of the GIL, and a daemon thread waiting
    for the GIL at interpreter exit aborts the process: `eval diff` exited with SIGABRT after its results)."""
    import threading
    import weakref

    monkeypatch.setenv("LMFORGE_KV_PREFAULT", "1")
    inside, release = threading.Event(), threading.Event()
    real = kv_pool._libc_madvise()

    def blocking_madvise(addr: int, length: int, advice: int) -> int:
        inside.set()
        release.wait(timeout=60)
        return real(addr, length, advice)

    monkeypatch.setattr(kv_pool, "_libc_madvise", lambda: blocking_madvise)
    pool = _pool()
    thread = pool.prefault
    assert inside.wait(timeout=60)
    tensors = [weakref.ref(t) for t in pool.k_pools_PBKH + pool.v_pools_PBKH]
    del pool
    gc.collect()
    try:
        assert all(r() is None for r in tensors)
    finally:
        release.set()
    thread.join(timeout=60)
    assert not thread.is_alive()
