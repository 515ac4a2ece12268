"""The pipeline-schedule simulator: the (P-1)/(M+P-1) formula in the uniform case, hand-computed
timelines with unequal stages and send times, in-flight memory of GPipe vs 1F1B, the CLI's files."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from lmforge.parallel.commands import app
from lmforge.parallel.pipeline import split_layers
from lmforge.parallel.schedules import bubble_formula, schedule
from lmforge.parallel.simulate import simulate


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("P,M", [(1, 1), (2, 1), (2, 4), (4, 1), (4, 4), (4, 16), (8, 3)])
def test_uniform_stages_match_the_formula(name, P, M):
    r = simulate(name, P, M, fwd_s=1.0, bwd_s=2.0)
    assert r.step_s == pytest.approx((M + P - 1) * 3.0)
    assert r.bubble == pytest.approx(bubble_formula(P, M))
    assert all(s.bubble == pytest.approx(bubble_formula(P, M)) for s in r.per_stage)


def test_schedules_run_every_action_once_and_1f1b_order():
    for name in ("gpipe", "1f1b"):
        for acts in schedule(name, 4, 6):
            assert sorted(acts) == sorted([("F", m) for m in range(6)] + [("B", m) for m in range(6)])
    assert schedule("1f1b", 3, 4)[0] == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1),
                                         ("B", 2), ("B", 3)]
    assert schedule("1f1b", 3, 4)[2] == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2),
                                         ("F", 3), ("B", 3)]


def test_hand_built_unequal_stages_with_send_time():
    # P=2, M=2, stage 0: f=1 b=2, stage 1: f=2 b=4, each hop 0.5 (worked out on paper, see below).
    g = simulate("gpipe", 2, 2, fwd_s=[1, 2], bwd_s=[2, 4], send_s=0.5)
    # stage 1: F0 1.5-3.5, F1 3.5-5.5, B0 5.5-9.5, B1 9.5-13.5; stage 0: B0 10-12, B1 14-16
    assert [e[3:] for e in g.events if e[0] == 0 and e[1] == "B"] == [(10.0, 12.0), (14.0, 16.0)]
    assert g.step_s == 16.0 and g.bubble == pytest.approx(1 - 18 / 32)
    o = simulate("1f1b", 2, 2, fwd_s=[1, 2], bwd_s=[2, 4], send_s=0.5)
    # stage 1: F0 1.5-3.5, B0 3.5-7.5, F1 7.5-9.5, B1 9.5-13.5; stage 0: B0 8-10, B1 14-16
    assert [e[3:] for e in o.events if e[0] == 1] == [(1.5, 3.5), (3.5, 7.5), (7.5, 9.5), (9.5, 13.5)]
    assert o.step_s == 16.0 and [s.peak_inflight for s in o.per_stage] == [2, 1]


def test_send_time_adds_to_the_critical_path():
    base, slow = simulate("gpipe", 4, 8, 1.0, 2.0), simulate("gpipe", 4, 8, 1.0, 2.0, send_s=0.25)
    assert slow.step_s == pytest.approx(base.step_s + 2 * 3 * 0.25)  # GPipe: 3 hops down and 3 back up
    # 1F1B waits for a round trip in its steady state too, so latency costs it more than GPipe
    o = simulate("1f1b", 4, 8, 1.0, 2.0, send_s=0.25)
    assert o.step_s > slow.step_s and o.bubble > slow.bubble > base.bubble


def test_in_flight_memory_gpipe_holds_M_1f1b_at_most_P_minus_s():
    P, M = 4, 8
    g = simulate("gpipe", P, M, 1.0, 2.0, act_bytes=10.0)
    o = simulate("1f1b", P, M, 1.0, 2.0, act_bytes=10.0)
    assert [s.peak_inflight for s in g.per_stage] == [M] * P and g.peak_act_bytes == M * 10.0
    assert [s.peak_inflight for s in o.per_stage] == [min(P - s, M) for s in range(P)]
    assert o.peak_act_bytes == P * 10.0


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="fwd_s"):
        simulate("gpipe", 4, 2, fwd_s=[1, 2], bwd_s=1)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        simulate("zigzag", 2, 2, 1, 1)


def test_cli_writes_run_directory(tmp_path):
    out = tmp_path / "sim"
    r = CliRunner().invoke(app, ["simulate", "--stages", "2", "-m", "4", "--fwd", "1,2", "--bwd", "2",
                                 "--send", "0.5", "--out", str(out)])
    assert r.exit_code == 0, r.output
    cells = json.loads((out / "simulate.json").read_text())
    assert [c["schedule"] for c in cells] == ["gpipe", "1f1b"]
    assert cells[0]["step_s"] == simulate("gpipe", 2, 4, [1, 2], 2, 0.5).step_s
    assert (out / "timeline-1f1b-P2-M4.png").stat().st_size > 0
    assert json.loads((out / "record.json").read_text())["status"] == "finished"
    bad = CliRunner().invoke(app, ["simulate", "--stages", "3", "--fwd", "1,x"])
    assert bad.exit_code != 0 and "--fwd" in bad.output


def test_split_layers_balanced_and_refuses_too_many_stages():
    assert split_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert split_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ValueError, match="num_hidden_layers=2"):
        split_layers(2, 3)


def test_scan_uses_the_shared_memory_model_and_ranks_fitting_layouts():
    from lmforge.perf import estimate as E
    from lmforge.parallel.scan import ScanSpec, scan

    r = scan(ScanSpec(model="llama-7b", gpus=8, nodes=1))
    ranked = r["ranked"]
    assert ranked and all(x["fits"] for x in ranked) and all(not x["fits"] for x in r["oom"])
    assert [x["step_s"] for x in ranked] == sorted(x["step_s"] for x in ranked)
    assert all(x["dp"] * x["tp"] * x["pp"] == 8 and x["dp"] * x["micro_batch"] * x["microbatches"] == 64
               for x in ranked)
    x = ranked[0]
    mem = E.memory("llama-7b", "full", dtype="bfloat16", batch=x["micro_batch"], seq_len=2048,
                   grad_ckpt=x["grad_ckpt"], dp_shard=x["dp"] if x["fsdp"] else 1, tp=x["tp"], pp=x["pp"])
    assert x["memory_GB"] == pytest.approx((mem.total + mem.overhead) / 1e9)
    assert r["naive"]["pure DP (DDP)"] is None  # 7B full fine-tuning with AdamW does not fit one 80 GB card


def test_scan_tp_across_nodes_pays_the_inter_node_link():
    from lmforge.parallel.scan import ScanSpec, scan

    one, two = scan(ScanSpec(gpus=8, nodes=1)), scan(ScanSpec(gpus=8, nodes=2, inter_bw_GBps=25))
    tp8 = [next(x for x in rep["ranked"] if x["name"] == "dp1 tp8 pp1 b8") for rep in (one, two)]
    assert tp8[0]["tp_link"] == "intra" and tp8[1]["tp_link"] == "inter"
    assert tp8[1]["tp_s"] > 10 * tp8[0]["tp_s"]  # 450 GB/s NVLink vs 25 GB/s per GPU between nodes
    assert two["tp_across_nodes"]["across"]["step_s"] > two["tp_across_nodes"]["inside"]["step_s"]
    assert two["gain_over_best_naive"] > 0.3


def test_scan_cli_writes_table_and_heatmap(tmp_path):
    r = CliRunner().invoke(app, ["scan", "--gpus", "8", "--nodes", "2", "--out", str(tmp_path / "scan")])
    assert r.exit_code == 0, r.output
    assert "tensor parallelism across nodes" in (tmp_path / "scan" / "scan.md").read_text()
    assert (tmp_path / "scan" / "heatmap.png").stat().st_size > 0
    bad = CliRunner().invoke(app, ["scan", "--gpus", "6", "--nodes", "4"])
    assert bad.exit_code != 0 and "multiple of --nodes" in bad.output
