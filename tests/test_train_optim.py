"""The optimizer: parameter groups and their learning rates, and a bitwise exact continuation from a
saved state_dict (what checkpoints store) with several groups."""

from __future__ import annotations

import copy

import pytest
import torch

from lmforge.model import ModelConfig, Transformer
from lmforge.train.config import TrainSection
from lmforge.train.optim import build_optimizer, build_scheduler


def tiny(tie: bool = True) -> Transformer:
    return Transformer(ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=tie)).init_weights(0)


def steps(model, opt, sched, n: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        ids = torch.randint(0, 128, (2, 16), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()


def test_default_groups_are_adamw_decay_and_no_decay():
    model = tiny()
    opt = build_optimizer(model, TrainSection(), torch.device("cpu"))
    assert type(opt) is torch.optim.AdamW and [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    emb = model.model.embed_tokens.weight
    assert any(p is emb for p in opt.param_groups[1]["params"])
    # weight_decay 0 keeps the same two groups, so the optimizer state (and a checkpoint) has one layout
    no_wd = build_optimizer(model, TrainSection(weight_decay=0.0), torch.device("cpu"))
    assert [len(g["params"]) for g in no_wd.param_groups] == [len(g["params"]) for g in opt.param_groups]


def test_embedding_and_head_learning_rates():
    model = tiny(tie=False)
    t = TrainSection(lr=1e-3, embedding_lr=0.2, head_lr=4e-3)
    opt = build_optimizer(model, t, torch.device("cpu"))
    by_param = {id(p): g for g in opt.param_groups for p in g["params"]}
    assert by_param[id(model.model.embed_tokens.weight)]["lr"] == 0.2
    assert by_param[id(model.lm_head.weight)]["lr"] == 4e-3 and by_param[id(model.lm_head.weight)]["weight_decay"] == 0.1
    q = model.model.layers[0].self_attn.q_proj.weight
    assert by_param[id(q)]["lr"] == 1e-3 and by_param[id(q)]["weight_decay"] == 0.1
    assert by_param[id(model.model.norm.weight)]["lr"] == 1e-3
    build_scheduler(opt, t)  # sets every group's rate: one warmup factor for all
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([g["initial_lr"] / t.warmup_steps
                                                                for g in opt.param_groups])


@pytest.mark.parametrize("embedding_lr", [None, 0.05])
def test_state_dict_continues_bitwise(embedding_lr):
    """Save model + optimizer + schedule after 3 steps, go on 3 steps; restore into fresh objects and do
    the same 3 steps: identical weights (what the trainer's resume relies on)."""
    t = TrainSection(embedding_lr=embedding_lr, warmup_steps=2, max_steps=6, lr=3e-3)
    model = tiny(tie=False)
    opt = build_optimizer(model, t, torch.device("cpu"))
    sched = build_scheduler(opt, t)
    assert len(opt.param_groups) == (2 if embedding_lr is None else 4)
    steps(model, opt, sched, 3, seed=0)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()})
    steps(model, opt, sched, 3, seed=1)

    model2 = tiny(tie=False)
    opt2 = build_optimizer(model2, t, torch.device("cpu"))
    sched2 = build_scheduler(opt2, t)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    steps(model2, opt2, sched2, 3, seed=1)
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), name
