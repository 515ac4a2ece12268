"""Pipeline parallelism: a `Transformer` cut into P stages of consecutive layers, one process per
stage, and an executor that runs a schedule (`schedules.py`: GPipe or 1F1B) over
`torch.distributed` point-to-point, timing every forward, backward, receive and send.

Every rank reads the same batch (the data loaders are deterministic), so stage 0 takes the token
ids, the last stage the labels, and every stage its micro-batch's `doc_ids` for the attention mask;
only activations (forward) and their gradients (backward) cross processes: one (b, T, D) tensor per
micro-batch per hop each way. Sends are `isend` (the sender keeps computing); receives block, and
the time blocked is idle time. The last stage returns the sum of token losses, scaled so that the
micro-batches add up to the batch's mean. With tied embeddings stage 0 and the last stage each hold
the matrix and all-reduce its gradient after the step (Megatron's embedding group).

Why not `torch.distributed.pipelining`'s `ScheduleGPipe`/`Schedule1F1B`: they run the same
schedules, but expose no per-action timestamps and send through their own stage objects; this file
is ~200 lines, follows the exact action lists the simulator reads, and records where every
millisecond goes. It knows nothing about optimizers or data loading.

Shape legend: b micro-batch rows, T tokens, D hidden, V vocabulary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lmforge.model import DenseAttention, Transformer, positions_from_doc_ids

from .schedules import Action

IGNORE = -100


def split_layers(num_layers: int, stages: int) -> list[range]:
    """Contiguous layer ranges, sizes differing by at most one (earlier stages get the extra ones)."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"pipeline stages must be between 1 and num_hidden_layers={num_layers}, got {stages}")
    base, extra = divmod(num_layers, stages)
    out, lo = [], 0
    for s in range(stages):
        hi = lo + base + (1 if s < extra else 0)
        out.append(range(lo, hi))
        lo = hi
    return out


class PipelineStageModule(nn.Module):
    """Stage `stage` of `stages`: (embedding on the first) + its layers + (norm and LM head on the last).
    The parameters are the full model's own objects, so names and values stay the model's."""

    def __init__(self, model: Transformer, stage: int, stages: int):
        super().__init__()
        self.stage, self.stages, self.hidden_size = stage, stages, model.config.hidden_size
        self.first, self.last = stage == 0, stage == stages - 1
        self.layer_range = split_layers(model.config.num_hidden_layers, stages)[stage]
        bb = model.model
        self.embed_tokens = bb.embed_tokens if self.first else None
        self.layers = nn.ModuleList(bb.layers[i] for i in self.layer_range)
        self.norm = bb.norm if self.last else None
        self.lm_head = model.lm_head if self.last else None
        self.rotary_emb = bb.rotary_emb
        self.tied = model.config.tie_word_embeddings and stages > 1
        if self.tied and self.last:  # the head's matrix is an embedding: the optimizer must not decay it
            self.tied_embedding = bb.embed_tokens
        self._names = [n for n, _ in model.named_parameters(remove_duplicate=False) if self._owns(n)]
        self._params = dict(model.named_parameters(remove_duplicate=False))

    def _owns(self, name: str) -> bool:
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) in self.layer_range
        return ((self.first and name.startswith("model.embed_tokens.")) or
                (self.last and name.startswith(("model.norm.", "lm_head."))))

    def full_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name in the full model, parameter) for this stage's parameters (a tied one under both names)."""
        return [(n, self._params[n]) for n in self._names]

    def tied_weight(self) -> nn.Parameter | None:
        if not self.tied:
            return None
        return self.embed_tokens.weight if self.first else self.lm_head.weight if self.last else None

    def forward(self, x: torch.Tensor, doc_ids_bT: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (b, T) on the first stage, hidden states (b, T, D) elsewhere -> hidden (b, T, D),
        or logits (b, T, V) on the last stage."""
        x_bTD = self.embed_tokens(x) if self.first else x
        b, T = x_bTD.shape[:2]
        pos_bT = positions_from_doc_ids(doc_ids_bT) if doc_ids_bT is not None else \
            torch.arange(T, device=x_bTD.device).expand(b, T)
        cos, sin = self.rotary_emb(pos_bT, x_bTD.dtype)
        attn = DenseAttention(doc_ids_bT)
        for layer in self.layers:
            x_bTD = layer(x_bTD, cos, sin, attn)
        return self.lm_head(self.norm(x_bTD)) if self.last else x_bTD


def loss_sum(logits_bTV: torch.Tensor, labels_bT: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over targets (labels != -100), in float32 or wider."""
    logits = logits_bTV if logits_bTV.dtype == torch.float64 else logits_bTV.float()
    return F.cross_entropy(logits.flatten(0, 1), labels_bT.flatten(), ignore_index=IGNORE, reduction="sum")


@dataclass
class Event:
    op: str  # F, B (compute), recv (blocked waiting), send (posting an isend)
    mb: int
    start: float  # time.perf_counter(): CLOCK_MONOTONIC, one clock for every process of a machine
    end: float
    cpu_s: float = 0.0  # thread CPU time of a compute action: < wall when the core is shared


@dataclass
class StepResult:
    loss_sum: float | None  # last stage: the sum of the scaled micro-batch losses
    events: list[Event] = field(default_factory=list)


class PipelineExecutor:
    """Runs one stage's action list for a step. `ranks[s]` is the global rank of stage s."""

    def __init__(self, module: PipelineStageModule, ranks: list[int], tied_group=None):
        self.m, self.ranks, self.tied_group = module, ranks, tied_group
        self.s = module.stage

    def _recv(self, shape, dtype, src_stage: int, mb: int, events: list[Event]) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype)
        t = time.perf_counter()
        dist.recv(buf, src=self.ranks[src_stage])
        events.append(Event("recv", mb, t, time.perf_counter()))
        return buf

    def _send(self, tensor: torch.Tensor, dst_stage: int, mb: int, events: list[Event], works: list) -> None:
        t = time.perf_counter()
        tensor = tensor.contiguous()
        works.append((dist.isend(tensor, dst=self.ranks[dst_stage]), tensor))  # keep the buffer alive
        events.append(Event("send", mb, t, time.perf_counter()))

    def step(self, plan: list[Action], microbatches: list[dict], scale: float, act_dtype: torch.dtype) -> StepResult:
        """Run `plan` (this stage's actions) over `microbatches` (dicts with input_ids, labels and
        optionally doc_ids, (b, T) each). Each micro-batch's summed loss is multiplied by `scale`
        (1 / the batch's target tokens: the micro-batches then sum to the mean). Gradients accumulate
        in the stage's parameters' .grad."""
        m, events, works = self.m, [], []
        saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        total = 0.0
        for op, mb in plan:
            batch = microbatches[mb]
            b, T = batch["input_ids"].shape
            if op == "F":
                if m.first:
                    x_in = batch["input_ids"]
                else:
                    x_in = self._recv((b, T, m.hidden_size), act_dtype, self.s - 1, mb, events).requires_grad_()
                t, c = time.perf_counter(), time.thread_time()
                out = m(x_in, batch.get("doc_ids"))
                if m.last:
                    out = loss_sum(out, batch["labels"]) * scale
                    total += float(out.detach())
                events.append(Event("F", mb, t, time.perf_counter(), time.thread_time() - c))
                if not m.last:
                    self._send(out.detach(), self.s + 1, mb, events, works)
                saved[mb] = (None if m.first else x_in, out)
            else:
                x_in, out = saved.pop(mb)
                grad = None if m.last else self._recv(out.shape, out.dtype, self.s + 1, mb, events)
                t, c = time.perf_counter(), time.thread_time()
                torch.autograd.backward(out, grad_tensors=grad)
                events.append(Event("B", mb, t, time.perf_counter(), time.thread_time() - c))
                if not m.first:
                    self._send(x_in.grad, self.s - 1, mb, events, works)
        for work, _ in works:
            work.wait()
        self.sync_tied()
        return StepResult(total if m.last else None, events)

    @torch.no_grad()
    def forward_only(self, batch: dict, act_dtype: torch.dtype) -> torch.Tensor | None:
        """One batch forward through the pipeline (evaluation): logits on the last stage, None elsewhere."""
        m, events = self.m, []
        b, T = batch["input_ids"].shape
        x = batch["input_ids"] if m.first else self._recv((b, T, m.hidden_size), act_dtype, self.s - 1, 0, events)
        out = m(x, batch.get("doc_ids"))
        if m.last:
            return out
        dist.send(out.contiguous(), dst=self.ranks[self.s + 1])
        return None

    def sync_tied(self) -> None:
        """Sum the tied embedding/LM-head gradient over the first and last stage."""
        w = self.m.tied_weight()
        if w is not None and w.grad is not None:
            dist.all_reduce(w.grad, group=self.tied_group)


def tied_group(stages: int, ranks: list[int], tie: bool):
    """The process group of the first and last stage for a tied embedding (every rank must call this)."""
    if not tie or stages < 2:
        return None
    return dist.new_group([ranks[0], ranks[-1]])
