"""The one RowParallelLinear (model/tensor_parallel.py), built the two ways its former twins were: for
training (trainable, autograd all-reduce, Hugging Face state-dict names) and for the engine (a plain
frozen nn.Linear shard that CPU packing can replace, an in-place all-reduce over its own group)."""

from __future__ import annotations

import torch
from torch import nn

from lmforge.model.tensor_parallel import (AutogradAllReduce, CommCounter, GroupAllReduce, RowParallelLinear,
                                           full_state_dict)


class _Done:
    def wait(self) -> None:
        pass


class _OneRankGroup:
    """A process group of one: its all-reduce leaves the tensor as it is."""

    def allreduce(self, tensors: list[torch.Tensor]) -> _Done:
        return _Done()


def test_training_and_engine_rows_agree_and_keep_their_shapes():
    torch.manual_seed(0)
    lin = nn.Linear(8, 6)
    x = torch.randn(2, 3, 8)
    counter_t, counter_e = CommCounter(), CommCounter()
    train = RowParallelLinear(lin, 0, 1, AutogradAllReduce(None, counter_t, 0, "attn"), trainable=True)
    engine = RowParallelLinear(lin, 0, 1, GroupAllReduce(_OneRankGroup(), counter_e, 0, "attn"))
    want = lin(x)
    assert torch.equal(train(x), want) and torch.equal(engine(x), want)
    assert set(counter_t.bytes) == {(0, "attn_fwd")} and set(counter_e.bytes) == {(0, "attn")}
    assert counter_t.per_layer() == counter_e.per_layer() == {0: 2 * 3 * 6 * 4}
    # the engine's shard is a plain frozen nn.Linear (what CPU packing swaps); its bias is no parameter
    assert type(engine.linear) is nn.Linear and not engine.linear.weight.requires_grad
    assert [n for n, _ in engine.named_parameters()] == ["linear.weight"]
    # training: trainable, and the state dict reads as an unsharded nn.Linear's
    assert all(p.requires_grad for p in train.parameters())
    assert list(train.state_dict()) == ["weight", "bias"]
    fresh = RowParallelLinear(nn.Linear(8, 6), 0, 1, AutogradAllReduce(None, CommCounter(), 0, "attn"), trainable=True)
    fresh.load_state_dict(lin.state_dict())
    assert torch.equal(fresh(x), want)
    assert all(torch.equal(full_state_dict(train)[k], v) for k, v in lin.state_dict().items())
