"""Joining the process group: which rank this process is, how many there are, which device it drives.

`init_distributed` joins the group torchrun describes (RANK / WORLD_SIZE / LOCAL_RANK) or runs alone;
`Dist` is the data-parallel view the trainer sums losses and token counts over. It knows nothing
about models, optimizers or checkpoints.

    d, device = init_distributed("auto")     # Dist(rank=0, world_size=1) outside torchrun
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lmforge.model import resolve_device


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    group: Any = None  # the data-parallel process group (None: the whole world)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_sum(self, *values: float) -> list[float]:
        if self.world_size == 1:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t, group=self.group)
        return t.tolist()


@dataclass
class GroupDist(Dist):
    """The data-parallel view of a rank: `rank`/`world_size` index the data shards; `main` is global rank 0."""

    global_rank: int = 0

    @property
    def main(self) -> bool:
        return self.global_rank == 0


def init_distributed(device_name: str) -> tuple[Dist, torch.device]:
    """Join the process group torchrun describes (RANK/WORLD_SIZE/LOCAL_RANK), or run alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist(), resolve_device(device_name)
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Dist(rank, world, local), device
