"""How fast this machine maps fresh memory: `madvise(MADV_POPULATE_WRITE)` over numpy's calloc'd buffers, as
`kv_pool._prefault` does for the K/V pool. Prints GB/s for the first buffer of the process, for buffers of the same
size allocated again after a free, and for two threads populating at once (the aggregate). On a VM whose host backs
guest memory lazily the first reads ~0.4 GB/s and the rest ~20 (2026-12-07, Zen 5): see docs/engine.md, "Where a
fresh bf16 prefill's time goes".

    python scripts/first_touch.py --mb 500
"""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import typer

MADV_POPULATE_WRITE = 23  # Linux 5.14+


def main(mb: int = typer.Option(500, help="MB a buffer."), rounds: int = 3) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    n = mb << 20

    def populate(buf: np.ndarray) -> float:
        start = (buf.__array_interface__["data"][0] + 4095) // 4096 * 4096
        t = time.perf_counter()
        if libc.madvise(start, n, MADV_POPULATE_WRITE) != 0:
            raise SystemExit(f"madvise failed (errno {ctypes.get_errno()}): Linux 5.14+ has MADV_POPULATE_WRITE")
        return time.perf_counter() - t

    for r in range(rounds):
        buf = np.zeros(n + 4096, dtype=np.uint8)
        dt = populate(buf)
        print(f"round {r}: {mb} MB in {dt * 1e3:.0f} ms = {mb / 1024 / dt:.2f} GB/s" + ("  (first in this process)" if r == 0 else ""))
        del buf
    bufs = [np.zeros(n + 4096, dtype=np.uint8) for _ in range(3)]
    populate(bufs[0])  # takes back the pages the rounds freed, so the two below get fresh ones
    t = time.perf_counter()
    threads = [threading.Thread(target=populate, args=(b,)) for b in bufs[1:]]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    dt = time.perf_counter() - t
    print(f"two threads, {mb} MB each, at once: {dt * 1e3:.0f} ms = {2 * mb / 1024 / dt:.2f} GB/s aggregate")


if __name__ == "__main__":
    typer.run(main)
