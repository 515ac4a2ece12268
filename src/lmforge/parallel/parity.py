"""Parity workers: each runs one parallel strategy on a tiny random model and returns losses,
gradients or outputs, so a caller can compare them with the single-process run of the same model
(`reference`). Used by the tests and by `lmforge bench parallel`; launched with
`launch.run_local` or under torchrun. Nothing is downloaded: the model and tokens are random.

    from lmforge.parallel.launch import run_local
    from lmforge.parallel.parity import Spec, pp_worker, reference
    got = run_local(pp_worker, 2, Spec())       # per rank: {schedule: {"loss", "grads"}}
    want = reference(Spec())                     # {"loss", "grads"} of one process
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmforge.model import ModelConfig, Transformer
from lmforge.model.tensor_parallel import apply_tensor_parallel, full_grads

from .pipeline import IGNORE, PipelineExecutor, PipelineStageModule, loss_sum, tied_group
from .schedules import schedule


@dataclass(frozen=True)
class Spec:
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 96
    tie_word_embeddings: bool = True
    batch: int = 8
    seq_len: int = 16
    microbatches: int = 4
    schedules: tuple[str, ...] = ("gpipe", "1f1b")
    dtype: str = "float64"
    seed: int = 0


def make_model(spec: Spec) -> Transformer:
    cfg = ModelConfig(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                      intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
                      num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
                      max_position_embeddings=spec.seq_len, tie_word_embeddings=spec.tie_word_embeddings)
    model = Transformer(cfg).init_weights(spec.seed)
    return model.to(getattr(torch, spec.dtype)).train()


def make_batch(spec: Spec) -> dict[str, torch.Tensor]:
    """Random tokens, next-token labels, two documents per row (so the document mask is exercised)
    and a few ignored targets."""
    g = torch.Generator().manual_seed(spec.seed + 1)
    ids = torch.randint(0, spec.vocab_size, (spec.batch, spec.seq_len + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[:, :2] = IGNORE
    doc_ids = (torch.arange(spec.seq_len) >= spec.seq_len // 2).long().expand(spec.batch, -1).contiguous()
    return {"input_ids": ids[:, :-1].contiguous(), "labels": labels, "doc_ids": doc_ids}


def split_microbatches(batch: dict[str, torch.Tensor], m: int) -> list[dict[str, torch.Tensor]]:
    if batch["input_ids"].shape[0] % m:
        raise ValueError(f"batch of {batch['input_ids'].shape[0]} rows does not split into {m} micro-batches")
    parts = {k: v.chunk(m) for k, v in batch.items()}
    return [{k: parts[k][i] for k in batch} for i in range(m)]


def reference(spec: Spec) -> dict:
    """Loss (the batch's mean over targets) and gradients of one process, the whole batch at once."""
    model, batch = make_model(spec), make_batch(spec)
    n = int((batch["labels"] != IGNORE).sum())
    loss = loss_sum(model(batch["input_ids"], doc_ids=batch["doc_ids"]), batch["labels"]) / n
    loss.backward()
    return {"loss": float(loss.detach()),
            "grads": {k: p.grad.clone() for k, p in model.named_parameters(remove_duplicate=False)}}


def pp_worker(rank: int, world: int, spec: Spec) -> dict:
    """Stage `rank` of a `world`-stage pipeline; per schedule: the loss (last stage), the stage's
    gradients by full-model name, and the step's events."""
    model, batch = make_model(spec), make_batch(spec)
    stage = PipelineStageModule(model, rank, world)
    ranks = list(range(world))
    ex = PipelineExecutor(stage, ranks, tied_group(world, ranks, stage.tied))
    n = int((batch["labels"] != IGNORE).sum())
    out = {}
    for name in spec.schedules:
        model.zero_grad(set_to_none=True)
        res = ex.step(schedule(name, world, spec.microbatches)[rank], split_microbatches(batch, spec.microbatches),
                      1.0 / n, getattr(torch, spec.dtype))
        out[name] = {"loss": res.loss_sum, "events": res.events,
                     "grads": {k: p.grad.clone() for k, p in stage.full_named_parameters()}}
    return out


def tp_worker(rank: int, world: int, spec: Spec, group=None) -> dict:
    """Tensor parallelism over `group` (default: all ranks): logits, loss, unsharded gradients and the
    all-reduce payload bytes per layer of one forward + backward of the whole batch."""
    model, batch = make_model(spec), make_batch(spec)
    counter = apply_tensor_parallel(model, group)
    n = int((batch["labels"] != IGNORE).sum())
    logits = model(batch["input_ids"], doc_ids=batch["doc_ids"])
    fwd_bytes = counter.per_layer()
    loss = loss_sum(logits, batch["labels"]) / n
    loss.backward()
    return {"loss": float(loss.detach()), "logits": logits.detach(), "grads": full_grads(model, group),
            "fwd_bytes_per_layer": fwd_bytes, "bytes_per_layer": counter.per_layer(),
            "bytes_by_kind": dict(counter.bytes), "calls_by_kind": dict(counter.calls)}
