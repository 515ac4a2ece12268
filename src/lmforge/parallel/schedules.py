"""Pipeline schedules as per-stage action lists: the one definition the simulator and the real
executor both follow, so a prediction and a measurement are about the same order of work.

An action is `("F", m)` (forward of micro-batch m) or `("B", m)` (its backward). Stage s runs its
list in order; F(s, m) waits for F(s-1, m)'s output, B(s, m) for B(s+1, m)'s input gradient.

- GPipe (Huang et al. 2019): every forward, then every backward (in micro-batch order, as
  `torch.distributed.pipelining.ScheduleGPipe` does). A stage holds M micro-batches' activations.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021): stage s runs min(P-1-s, M) warm-up forwards, then
  alternates one forward and one backward, then drains the remaining backwards. Same bubble as
  GPipe, but at most min(P-s, M) micro-batches in flight on stage s.

It knows nothing about tensors or time.

    from lmforge.parallel.schedules import schedule
    schedule("1f1b", stages=4, microbatches=8)[0][:5]   # [('F', 0), ('F', 1), ('F', 2), ('F', 3), ('B', 0)]
"""

from __future__ import annotations

from typing import Literal

Action = tuple[str, int]
ScheduleName = Literal["gpipe", "1f1b"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")


def gpipe(stages: int, microbatches: int) -> list[list[Action]]:
    one = [("F", m) for m in range(microbatches)] + [("B", m) for m in range(microbatches)]
    return [list(one) for _ in range(stages)]


def one_f_one_b(stages: int, microbatches: int) -> list[list[Action]]:
    out = []
    for s in range(stages):
        warmup = min(stages - 1 - s, microbatches)
        acts: list[Action] = [("F", m) for m in range(warmup)]
        for i in range(microbatches - warmup):  # steady state: F of the next, B of the oldest
            acts += [("F", warmup + i), ("B", i)]
        acts += [("B", m) for m in range(microbatches - warmup, microbatches)]
        out.append(acts)
    return out


def schedule(name: str, stages: int, microbatches: int) -> list[list[Action]]:
    """Per-stage action lists for `name` in SCHEDULES."""
    if stages < 1 or microbatches < 1:
        raise ValueError(f"stages and microbatches must be >= 1, got {stages} and {microbatches}")
    key = name.lower().replace("-", "")
    if key == "gpipe":
        return gpipe(stages, microbatches)
    if key == "1f1b":
        return one_f_one_b(stages, microbatches)
    raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")


def bubble_formula(stages: int, microbatches: int) -> float:
    """(P-1)/(M+P-1): the idle fraction of every stage with equal stage times and free sends."""
    return (stages - 1) / (microbatches + stages - 1)
