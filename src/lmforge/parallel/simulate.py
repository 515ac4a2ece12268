"""A discrete-event simulator of pipeline schedules: per-stage forward/backward times, a send
time per hop and the activation memory of one micro-batch in, bubble fraction, step time and
peak activation memory out.

Every stage runs its action list (`schedules.py`) in order; an action starts when its stage is
free and its input has arrived: F(s, m) at F(s-1, m)'s end + send, B(s, m) at B(s+1, m)'s end +
send. Sends do not occupy the sender (the executor posts them with `isend`); they only delay
the receiver. With equal stage times and free sends both schedules give a step of
(M+P-1)(f+b) and the bubble (P-1)/(M+P-1). A stage holds a micro-batch's activations from the
start of its forward to the end of its backward. It knows nothing about tensors or processes.

    lmforge parallel simulate --schedule 1f1b --stages 4 --microbatches 8 --fwd 1 --bwd 2 --out runs/sim
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .schedules import bubble_formula, schedule


@dataclass
class StageResult:
    busy_s: float
    idle_s: float
    bubble: float  # idle_s / step_s
    peak_inflight: int  # micro-batches whose activations are held at once
    peak_act_bytes: float


@dataclass
class SimResult:
    schedule: str
    stages: int
    microbatches: int
    step_s: float
    bubble: float  # 1 - sum(busy) / (P * step): the mean of the stages' idle fractions
    formula_bubble: float
    peak_act_bytes: float  # the largest stage's
    per_stage: list[StageResult]
    events: list[tuple[int, str, int, float, float]] = field(repr=False)  # (stage, op, mb, start, end)

    def to_dict(self, events: bool = False) -> dict:
        d = asdict(self)
        if not events:
            d.pop("events")
        return d


def _per_stage(x: float | list[float], stages: int, name: str) -> list[float]:
    vals = [float(x)] * stages if isinstance(x, (int, float)) else [float(v) for v in x]
    if len(vals) != stages or any(v < 0 for v in vals):
        raise ValueError(f"{name}: need one non-negative value or {stages} of them, got {x!r}")
    return vals


def simulate(schedule_name: str, stages: int, microbatches: int, fwd_s: float | list[float],
             bwd_s: float | list[float], send_s: float = 0.0,
             act_bytes: float | list[float] = 0.0) -> SimResult:
    """Simulate one optimizer step of `schedule_name` (see `schedules.SCHEDULES`)."""
    P, M = stages, microbatches
    f, b = _per_stage(fwd_s, P, "fwd_s"), _per_stage(bwd_s, P, "bwd_s")
    act = _per_stage(act_bytes, P, "act_bytes")
    plan = schedule(schedule_name, P, M)
    done: dict[tuple[str, int, int], float] = {}  # (op, stage, mb) -> end time
    free, nxt = [0.0] * P, [0] * P
    events: list[tuple[int, str, int, float, float]] = []
    remaining = sum(len(a) for a in plan)
    while remaining:
        progressed = False
        for s in range(P):
            while nxt[s] < len(plan[s]):
                op, m = plan[s][nxt[s]]
                dep = (op, s - 1, m) if op == "F" else (op, s + 1, m)
                first_hop = (op == "F" and s == 0) or (op == "B" and s == P - 1)
                if op == "B" and s == P - 1:
                    dep = ("F", s, m)  # the loss is on this stage: no hop
                if not first_hop and dep not in done:
                    break
                ready = done.get(dep, 0.0) + (0.0 if first_hop else send_s)
                start = max(free[s], ready)
                end = start + (f[s] if op == "F" else b[s])
                done[(op, s, m)] = free[s] = end
                events.append((s, op, m, start, end))
                nxt[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule_name} deadlocks at stages={P} microbatches={M}")
    step = max(free)
    per_stage = []
    for s in range(P):
        busy = M * (f[s] + b[s])
        inflight = peak = 0
        for op, _ in plan[s]:
            inflight += 1 if op == "F" else -1
            peak = max(peak, inflight)
        per_stage.append(StageResult(busy, step - busy, (step - busy) / step if step else 0.0, peak, peak * act[s]))
    total_busy = sum(r.busy_s for r in per_stage)
    return SimResult(schedule_name, P, M, step, 1 - total_busy / (P * step) if step else 0.0,
                     bubble_formula(P, M), max(r.peak_act_bytes for r in per_stage), per_stage, events)


def to_markdown(results: list[SimResult]) -> str:
    lines = ["| schedule | P | M | step | bubble (sim) | bubble (formula) | peak in-flight per stage | "
             "peak activation bytes |", "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in results:
        inflight = ", ".join(str(s.peak_inflight) for s in r.per_stage)
        lines.append(f"| {r.schedule} | {r.stages} | {r.microbatches} | {r.step_s:.4g} | {r.bubble:.3f} | "
                     f"{r.formula_bubble:.3f} | {inflight} | {r.peak_act_bytes:.4g} |")
    return "\n".join(lines) + "\n"
