"""`lmforge parallel scan`: enumerate data x tensor x pipeline parallel layouts, micro-batch sizes,
sharding and activation checkpointing for a model on N GPUs in K nodes; drop what does not fit;
predict each step time; rank.

One model, shared: memory is `perf.estimate.memory` (the performance lab's calculator), the bytes
of each collective `perf.estimate.dp_allreduce / fsdp_traffic / tp_allreduce / pp_sends`, the
device `perf.estimate.device_spec` (datasheet peaks, memory, NVLink). This file adds only what those
do not know: where each group's ranks sit and therefore which link it uses, and how the pieces of a
step add up.

Placement: rank = (d * pp + p) * tp + t, nodes hold consecutive ranks. A TP group is tp consecutive
ranks: inside a node while tp <= GPUs per node, else across nodes at the inter-node bandwidth. A PP
group spans tp*pp consecutive ranks; the DP group spans all of them (across nodes when K > 1).

Step time of one optimizer step (global batch B sequences of T tokens, micro-batch b, M = B/(dp*b)
micro-batches per pipeline):
  stage time per micro-batch = roofline(3 x forward FLOPs of b*T tokens / (tp*pp), weight reads)
                              (x 4/3 with activation checkpointing: one more forward)
                              + its layers' TP all-reduces (4 per layer, ring, + latency each)
  pipeline = the 1F1B simulator (`simulate.py`) over pp stages and M micro-batches, backward = 2 x
             forward, one activation send per hop (pp = 1: M micro-batches back to back)
  step = pipeline + DP gradient all-reduce (DDP, fp32 gradients) or FSDP's all-gather x 2 +
         reduce-scatter (bf16), not overlapped with compute (a pessimistic bound for DP).
Compute runs at `efficiency` x peak (default 0.5: what well-tuned dense training reaches).

It knows nothing about tensors: nothing here imports torch.

    lmforge parallel scan --model llama-7b --gpus 8 --nodes 1 --gpu "H100 SXM" --out runs/scan-7b-1node
    lmforge parallel scan --model llama-7b --gpus 16 --nodes 2 --inter-bw 25 --out runs/scan-7b-2nodes
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from lmforge.perf import estimate as E

from .simulate import simulate

GB = 1e9
MICRO_BATCHES = (1, 2, 4, 8)


@dataclass(frozen=True)
class ScanSpec:
    model: str = "llama-7b"
    gpus: int = 8
    nodes: int = 1
    gpu: str = "H100 SXM"
    intra_bw_GBps: float | None = None  # None = the GPU's datasheet NVLink figure
    inter_bw_GBps: float = 25.0  # per GPU, one direction: 200 Gb/s InfiniBand per GPU
    global_batch: int = 64  # sequences per optimizer step
    seq_len: int = 2048
    efficiency: float = 0.5  # achieved / peak FLOP/s of the matmuls
    dtype: str = "bfloat16"
    intra_latency_s: float = 10e-6  # per collective call (NCCL small-message latency order)
    inter_latency_s: float = 25e-6
    p2p_latency_s: float | None = None  # per pipeline send; None = the collective latency of its link


@dataclass
class Layout:
    dp: int
    tp: int
    pp: int
    micro_batch: int
    microbatches: int  # per pipeline (grad accumulation when pp = 1)
    fsdp: bool
    grad_ckpt: bool
    memory_GB: float
    fits: bool
    tp_link: str
    dp_link: str
    compute_s: float
    tp_s: float
    bubble: float
    pipeline_s: float
    dp_s: float
    step_s: float
    tokens_per_s: float

    @property
    def name(self) -> str:
        return (f"dp{self.dp}{'-fsdp' if self.fsdp else ''} tp{self.tp} pp{self.pp} b{self.micro_batch}"
                f"{' ckpt' if self.grad_ckpt else ''}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def links(spec: ScanSpec, dev: E.Device | None = None) -> tuple[float, float]:
    dev = dev or E.device_spec(spec.gpu)
    intra = spec.intra_bw_GBps * GB if spec.intra_bw_GBps else dev.interconnect
    if not intra:
        raise ValueError(f"{dev.name}: no interconnect bandwidth in the datasheet table; pass --intra-bw GB/s")
    return intra, spec.inter_bw_GBps * GB


def evaluate(spec: ScanSpec, shape: E.ModelShape, dp: int, tp: int, pp: int, b: int, fsdp: bool,
             ckpt: bool, dev: E.Device | None = None) -> Layout:
    """Memory and predicted step time of one layout (on `dev`, default the datasheet's `spec.gpu`)."""
    dev = dev or E.device_spec(spec.gpu)
    intra, inter = links(spec, dev)
    latency = {"intra": spec.intra_latency_s, "inter": spec.inter_latency_s}
    per_node = spec.gpus // spec.nodes
    M = spec.global_batch // (dp * b)
    mem = E.memory(shape, "full", dtype=spec.dtype, batch=b, seq_len=spec.seq_len, grad_ckpt=ckpt,
                   dp_shard=dp if fsdp else 1, tp=tp, pp=pp)
    need = mem.total + mem.overhead
    tp_link = "intra" if tp <= per_node else "inter"
    dp_link = "intra" if spec.nodes == 1 else "inter"
    pp_link = "intra" if tp * pp <= per_node else "inter"
    bw = {"intra": intra, "inter": inter}
    # roofline of one micro-batch on one stage: FLOPs at efficiency x peak, or the weight reads
    tokens = b * spec.seq_len
    flops = 3 * E.forward_flops_per_token(shape, spec.seq_len / 2) * tokens / (tp * pp) * (4 / 3 if ckpt else 1)
    reads = 3 * E.weight_bytes(shape, spec.dtype) / (tp * pp)
    compute = max(flops / (dev.peak(spec.dtype) * spec.efficiency), reads / dev.require_bandwidth())
    tp_s = 0.0
    if tp > 1:
        _, t = E.tp_allreduce(shape, tp, b, spec.seq_len, bw[tp_link], spec.dtype)
        tp_s = t / pp + 4 * math.ceil(shape.layers / pp) * latency[tp_link]
    stage = compute + tp_s
    if pp > 1:
        _, send = E.pp_sends(shape, pp, b, spec.seq_len, 1, bw[pp_link], spec.dtype, training=False)
        hop = spec.p2p_latency_s if spec.p2p_latency_s is not None else latency[pp_link]
        sim = simulate("1f1b", pp, M, stage / 3, 2 * stage / 3, send + hop)
        pipeline, bubble = sim.step_s, sim.bubble
    else:
        pipeline, bubble = M * stage, 0.0
    dp_s = 0.0
    if dp > 1:
        if fsdp:  # all-gather in forward and backward, reduce-scatter: per layer, and the root's
            _, dp_s = E.fsdp_traffic(shape, dp, bw[dp_link], spec.dtype)
            calls = 3 * (math.ceil(shape.layers / pp) + 1)
        else:
            _, dp_s = E.dp_allreduce(shape, dp, bw[dp_link], "float32")
            calls = 1  # gradient buckets; one for small models
        dp_s = dp_s / (tp * pp) + calls * latency[dp_link]  # each DP group reduces its own shard of the model
    step = pipeline + dp_s
    return Layout(dp, tp, pp, b, M, fsdp, ckpt, need / GB, dev.memory is None or need <= dev.memory, tp_link,
                  dp_link, M * compute, M * tp_s, bubble, pipeline, dp_s, step,
                  spec.global_batch * spec.seq_len / step)


def scan(spec: ScanSpec) -> dict:
    """Every layout, the fitting ones ranked by predicted step time, and the naive references."""
    if spec.gpus % spec.nodes:
        raise ValueError(f"--gpus {spec.gpus} must be a multiple of --nodes {spec.nodes}")
    shape = E.ModelShape.from_config(spec.model)
    rows = []
    for tp in _divisors(spec.gpus):
        if shape.heads % tp or shape.kv_heads % tp:
            continue
        for pp in _divisors(spec.gpus // tp):
            if pp > shape.layers:
                continue
            dp = spec.gpus // (tp * pp)
            for b in MICRO_BATCHES:
                if spec.global_batch % (dp * b):
                    continue
                for fsdp in ((False, True) if dp > 1 else (False,)):
                    for ckpt in (False, True):
                        rows.append(evaluate(spec, shape, dp, tp, pp, b, fsdp, ckpt))
    fitting = sorted((r for r in rows if r.fits), key=lambda r: r.step_s)
    best = fitting[0] if fitting else None

    def best_of(pred) -> Layout | None:
        cands = [r for r in fitting if pred(r)]
        return cands[0] if cands else None

    naive = {"pure DP (DDP)": best_of(lambda r: r.dp == spec.gpus and not r.fsdp),
             "pure DP (FSDP)": best_of(lambda r: r.dp == spec.gpus and r.fsdp),
             "TP = all GPUs": best_of(lambda r: r.tp == spec.gpus)}
    gains = {k: (v.step_s / best.step_s - 1) if (v and best) else None for k, v in naive.items()}
    naive_fit = [v for v in naive.values() if v]
    tp_cross = None
    if spec.nodes > 1:  # the same layouts with TP inside vs across nodes
        inside = best_of(lambda r: r.tp_link == "intra" and r.tp > 1)
        across = best_of(lambda r: r.tp_link == "inter")
        tp_cross = {"inside": asdict(inside) if inside else None, "across": asdict(across) if across else None}
    return {"spec": asdict(spec), "shape": asdict(shape), "layouts": len(rows), "fitting": len(fitting),
            "ranked": [asdict(r) | {"name": r.name} for r in fitting],
            "oom": [asdict(r) | {"name": r.name} for r in rows if not r.fits],
            "best": asdict(best) | {"name": best.name} if best else None,
            "naive": {k: (asdict(v) | {"name": v.name}) if v else None for k, v in naive.items()},
            "gain_over_naive": gains,
            "gain_over_best_naive": (min(v.step_s for v in naive_fit) / best.step_s - 1) if naive_fit and best else None,
            "tp_across_nodes": tp_cross, "links_GBps": [x / GB for x in links(spec)]}


def heatmap_grid(report: dict) -> tuple[list[str], list[str], list[list[float | None]]]:
    """Best predicted step time (s) per (tp, pp) (dp = gpus / (tp pp)), over micro-batch, sharding and
    checkpointing; None where nothing fits, "—" where the combination does not exist."""
    ranked = report["ranked"] + report["oom"]
    tps = sorted({r["tp"] for r in ranked})
    pps = sorted({r["pp"] for r in ranked})
    grid = []
    for tp in tps:
        row = []
        for pp in pps:
            fit = [r["step_s"] for r in report["ranked"] if r["tp"] == tp and r["pp"] == pp]
            exists = any(r["tp"] == tp and r["pp"] == pp for r in ranked)
            row.append(min(fit) if fit else None if exists else "—")
        grid.append(row)
    return [f"tp{t}" for t in tps], [f"pp{p}" for p in pps], grid


def _row(r: dict) -> str:
    return (f"| {r['name']} | {r['microbatches']} | {r['memory_GB']:.1f} | {r['compute_s']:.3f} | {r['tp_s']:.3f} "
            f"({r['tp_link']}) | {r['bubble']:.1%} | {r['dp_s']:.3f} ({r['dp_link']}) | {r['step_s']:.3f} | "
            f"{r['tokens_per_s']:,.0f} |")


def to_markdown(report: dict, top: int = 12) -> str:
    s = report["spec"]
    intra, inter = report["links_GBps"]
    head = ["| layout | M | memory GB | compute s | TP s (link) | bubble | DP s (link) | step s | tokens/s |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines = [f"# parallel scan: {s['model']} on {s['gpus']}x {s['gpu']} in {s['nodes']} node(s)", "",
             f"global batch {s['global_batch']} x {s['seq_len']} tokens, {s['dtype']}, AdamW; links: intra "
             f"{intra:g} GB/s, inter {inter:g} GB/s per GPU; compute at {s['efficiency']:.0%} of peak. "
             f"{report['layouts']} layouts, {report['fitting']} fit.", "", "## best layouts", "", *head]
    lines += [_row(r) for r in report["ranked"][:top]]
    lines += ["", "## naive layouts (best micro-batch / checkpointing of each)", "", *head]
    for k, r in report["naive"].items():
        lines.append(_row(r) if r else f"| {k}: nothing fits | | | | | | | | |")
    lines.append("")
    for k, g in report["gain_over_naive"].items():
        lines.append(f"- {k}: " + (f"takes {g:.0%} longer per step than the best ({1 + g:.2f}x its time)"
                                    if g is not None else "does not fit"))
    if report["gain_over_best_naive"] is not None:
        g = report["gain_over_best_naive"]
        lines.append(f"- **predicted gain of the best layout over the best naive one: {1 + g:.2f}x the "
                     f"throughput ({g:.0%} faster)**")
    tc = report.get("tp_across_nodes")
    if tc and tc["across"]:
        a, i = tc["across"], tc["inside"]
        lines += ["", "## tensor parallelism across nodes", "",
                  f"The fastest layout whose TP group crosses nodes ({a['tp']}-way, "
                  f"{a['tp_s']:.2f} s of all-reduce per step at {inter:g} GB/s) takes {a['step_s']:.2f} s; the fastest "
                  f"with TP inside a node ({i['tp']}-way, {i['tp_s']:.2f} s at {intra:g} GB/s) takes {i['step_s']:.2f} s. "
                  f"TP all-reduces the activations 4 times per layer, a volume that does not shrink with the "
                  f"TP degree, so it must stay on the fastest link."]
    return "\n".join(lines) + "\n"
