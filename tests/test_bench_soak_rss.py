"""`lmforge bench soak`'s resident-memory curve (issue 43): the sampler, the per-engine growth after it
settles (a leak keeps growing, a high-water mark does not), the table in soak.md and the PNG.

    python -m pytest -q tests/test_bench_soak_rss.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from lmforge.bench.soak import RssSampler, _rss_markdown, engine_rss_growth, plot_rss


def _samples(curve: dict[int, list[float]], every: float = 10.0) -> list[dict]:
    out, t = [], 0.0
    for pid, mibs in curve.items():
        for m in mibs:
            out.append({"t_s": t, "phase": "soak", "server_mib": 100.0, "server_pid": 1, "engine_mib": m,
                        "engine_pid": pid, "writer_mib": 40.0, "writer_pid": 3})
            t += every
    return out


def test_growth_is_measured_per_engine_after_it_settles():
    plateau = [700, 900, 1000, 1050] + [1080] * 100  # fills up, then flat: a high-water mark
    leak = [700 + 10 * i for i in range(45)]  # never stops
    (hwm,) = engine_rss_growth(_samples({11: plateau}))
    assert hwm["settled_at_s"] == 300 and abs(hwm["growth_after_settle"]) < 0.01 and hwm["peak_mib"] == 1080
    (grows,) = engine_rss_growth(_samples({12: leak}))
    assert grows["growth_after_settle"] > 0.1
    first, second = engine_rss_growth(_samples({13: [500, 600, 650], 14: [400, 500, 520, 530]}))
    assert (first["pid"], second["pid"]) == (13, 14) and second["settled_mib"] == 500  # a third of a short life


def test_the_sampler_follows_the_process_and_its_children(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(64 << 20); time.sleep(30)"])
    try:
        time.sleep(1.0)
        with RssSampler(os.getpid(), 0.2) as rss:
            rss.phase = "soak"
            time.sleep(0.7)
    finally:
        child.kill()
        child.wait()
    assert len(rss.samples) >= 3 and rss.samples[-1]["phase"] == "soak"
    assert all(s["server_mib"] > 0 and s["engine_pid"] == child.pid and s["engine_mib"] >= 64 for s in rss.samples)
    report = {"config": {"rss_every_s": 0.2}, "rss_samples": rss.samples, "engine_rss": engine_rss_growth(rss.samples)}
    text = "\n".join(_rss_markdown(report))
    assert "| t (s) | phase | server | engine | writer |" in text and f"engine pid {child.pid}" in text
    assert plot_rss(rss.samples, tmp_path / "soak_rss.png").stat().st_size > 1000
