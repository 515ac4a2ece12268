"""Megatron-style tensor parallelism (Shoeybi et al. 2019) for the `Transformer`, in place.

Each decoder layer's attention and MLP become one column-parallel and one row-parallel matmul:
q/k/v and gate/up keep rank r's slice of output rows (whole heads: N/tp query and K/tp key/value
heads each), o_proj and down_proj rank r's slice of input columns. Two autograd functions carry
all of the communication, as in Megatron's paper (section 3, "f" and "g"):
  f = `copy_to_tp`:     forward identity,   backward all-reduce of the input gradient (b, T, D)
  g = `reduce_from_tp`: forward all-reduce of the partial output (b, T, D), backward identity
so a layer all-reduces 2 activations forward and 2 gradients backward, each b*T*D elements,
whatever the TP degree: the per-layer bytes do not depend on N (the wire bytes of a ring all-reduce
are 2(N-1)/N of that per rank, approaching 2x). Embedding, norms and the LM head stay replicated
(their gradients come out whole on every rank: f all-reduced their inputs' gradients); Qwen3's
per-head q/k norms see only their heads, so their gradients are all-reduced by a hook.

Every all-reduce goes through a `CommCounter`, which records its payload bytes by layer and kind;
that is the measurement `bytes_per_layer` reports. It knows nothing about optimizers or data.

These are the one set of tensor-parallel layers: training (`apply_tensor_parallel`, autograd through
`AutogradAllReduce`) and the inference engine (`lmforge.engine.executor.shard_model`: plain
`nn.Linear` shards the CPU packing can replace, `GroupAllReduce` over the engine's own process group)
both build `RowParallelLinear` and count with `CommCounter`. They live with the model, below both.

Shape legend: b rows, T tokens, D hidden, N/K query/kv heads, H head dim, F MLP hidden.

    from lmforge.model.tensor_parallel import apply_tensor_parallel
    counter = apply_tensor_parallel(model, group=None)   # the default group: tp = world size
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


class CommCounter:
    """Payload bytes of every all-reduce, keyed by (layer, kind); kind is attn/mlp and fwd/bwd."""

    def __init__(self) -> None:
        self.bytes: dict[tuple[int, str], int] = defaultdict(int)
        self.calls: dict[tuple[int, str], int] = defaultdict(int)

    def add(self, layer: int, kind: str, t: torch.Tensor) -> None:
        self.bytes[(layer, kind)] += t.numel() * t.element_size()
        self.calls[(layer, kind)] += 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def per_layer(self) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for (layer, _), n in self.bytes.items():
            out[layer] += n
        return dict(out)


def _all_reduce(t: torch.Tensor, group, counter: CommCounter, layer: int, kind: str) -> torch.Tensor:
    counter.add(layer, kind, t)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, counter, layer, kind):
        ctx.group, ctx.counter, ctx.layer, ctx.kind = group, counter, layer, kind
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.contiguous().clone(), ctx.group, ctx.counter, ctx.layer, ctx.kind + "_bwd"), \
            None, None, None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, counter, layer, kind):
        return _all_reduce(x.contiguous().clone(), group, counter, layer, kind + "_fwd")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None, None


class ColumnParallelLinear(nn.Module):
    """y_local = x @ W[rows of rank r].T (+ b[rows]): rank r computes its slice of the output features."""

    def __init__(self, linear: nn.Linear, rank: int, size: int):
        super().__init__()
        out = linear.out_features
        if out % size:
            raise ValueError(f"{out} output features do not split over tensor_parallel={size}")
        rows = slice(rank * out // size, (rank + 1) * out // size)
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
        self.bias = nn.Parameter(linear.bias.detach()[rows].clone()) if linear.bias is not None else None
        self.full_shape, self.split_dim = tuple(linear.weight.shape), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class AutogradAllReduce:
    """Training's reduction of a row-parallel output: Megatron's g (all-reduce forward, identity backward)."""

    def __init__(self, group, counter: CommCounter, layer: int, kind: str):
        self.group, self.counter, self.layer, self.kind = group, counter, layer, kind

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        return _ReduceFromTP.apply(y, self.group, self.counter, self.layer, self.kind)


class GroupAllReduce:
    """Inference's reduction: in place over a process-group object of its own (not torch.distributed's
    default group, so an engine never touches a training job's group); no autograd."""

    def __init__(self, group, counter: CommCounter, layer: int, kind: str):
        self.group, self.counter, self.layer, self.kind = group, counter, layer, kind

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        y = y.contiguous()
        self.counter.add(self.layer, self.kind, y)
        self.group.allreduce([y]).wait()
        return y


def plain_linear(weight: torch.Tensor, bias: torch.Tensor | None, trainable: bool = False) -> nn.Linear:
    """An `nn.Linear` holding copies of `weight` (out, in) and `bias`; frozen unless `trainable`."""
    out_f, in_f = weight.shape
    lin = nn.Linear(in_f, out_f, bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight.clone(), requires_grad=trainable)
    if bias is not None:
        lin.bias = nn.Parameter(bias.clone(), requires_grad=trainable)
    return lin


class RowParallelLinear(nn.Module):
    """y = reduce(x_local @ W[:, cols of rank r].T) + b: each rank's partial product, summed over ranks by
    `reduce`, then the replicated bias once. The shard is a plain `nn.Linear` (`linear`), so inference's
    CPU weight packing can replace it as it replaces any other linear. For training (`trainable`), the
    weight and bias are trained and the state dict keeps Hugging Face's names (`o_proj.weight`, not
    `o_proj.linear.weight`), so sharded checkpoints read as before."""

    def __init__(self, linear: nn.Linear, rank: int, size: int, reduce: Callable[[torch.Tensor], torch.Tensor],
                 trainable: bool = False):
        super().__init__()
        inp = linear.in_features
        if inp % size:
            raise ValueError(f"{inp} input features do not split over tensor_parallel={size}")
        cols = slice(rank * inp // size, (rank + 1) * inp // size)
        self.linear = plain_linear(linear.weight.detach()[:, cols], None, trainable)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        self.bias = nn.Parameter(bias) if trainable and bias is not None else bias
        self.full_shape, self.split_dim, self.reduce = tuple(linear.weight.shape), 1, reduce
        if trainable:
            self._register_state_dict_hook(_hf_names)
            self._register_load_state_dict_pre_hook(_from_hf_names)

    @property
    def weight(self) -> nn.Parameter:
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.reduce(self.linear(x))
        return y + self.bias if self.bias is not None else y


def _hf_names(module: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
    """`prefix.linear.weight` -> `prefix.weight`, ahead of the bias (the order of an unsharded nn.Linear)."""
    weight = state.pop(prefix + "linear.weight")
    bias = state.pop(prefix + "bias", None)
    state[prefix + "weight"] = weight
    if bias is not None:
        state[prefix + "bias"] = bias


def _from_hf_names(state: dict, prefix: str, *args: Any) -> None:
    if prefix + "weight" in state:
        state[prefix + "linear.weight"] = state.pop(prefix + "weight")


def _split_check(model: nn.Module, size: int) -> None:
    c = model.config
    for name, n in (("num_attention_heads", c.num_attention_heads), ("num_key_value_heads", c.num_key_value_heads),
                    ("intermediate_size", c.intermediate_size)):
        if n % size:
            raise ValueError(f"tensor_parallel={size} must divide {name}={n}")


def apply_tensor_parallel(model: nn.Module, group=None, counter: CommCounter | None = None) -> CommCounter:
    """Shard every decoder layer of `model` (a `Transformer`, identical on every rank of `group`) in place
    over `group` (None: the default group; no process group at all: tp=1, the all-reduces only count)."""
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    _split_check(model, size)
    counter = counter or CommCounter()
    for i, layer in enumerate(model.model.layers):
        for block, kind, names in ((layer.self_attn, "attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                                   (layer.mlp, "mlp", ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                lin = getattr(block, name)
                setattr(block, name, ColumnParallelLinear(lin, rank, size) if name not in ROW else RowParallelLinear(
                    lin, rank, size, AutogradAllReduce(group, counter, i, kind), trainable=True))
            # f once per block: q, k and v (gate and up) share the input, so one all-reduce of its gradient
            block.register_forward_pre_hook(
                lambda _m, args, i=i, kind=kind: (_CopyToTP.apply(args[0], group, counter, i, kind), *args[1:]))
        attn = layer.self_attn
        attn.n_heads, attn.n_kv_heads = attn.n_heads // size, attn.n_kv_heads // size
        for norm in (attn.q_norm, attn.k_norm):
            if norm is not None and size > 1:  # sees only this rank's heads: sum the partial gradients
                norm.weight.register_hook(lambda g: _all_reduce(g.clone(), group, CommCounter(), -1, "qk_norm"))
    model.tensor_parallel = (rank, size)
    return counter


def split_dims(model: nn.Module) -> dict[int, int]:
    """id(parameter) -> the dimension it is split along, for every sharded parameter of `model`
    (a row-parallel bias is replicated: not in it)."""
    dims = {}
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear):
            dims[id(module.weight)] = 0
            if module.bias is not None:
                dims[id(module.bias)] = 0
        elif isinstance(module, RowParallelLinear):
            dims[id(module.linear.weight)] = 1
    return dims


def _gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's shard of `t`, concatenated along `dim` (collective)."""
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    if size == 1:
        return torch.cat([t.detach()], dim=dim)
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def full_state_dict(model: nn.Module, group=None) -> dict[str, torch.Tensor]:
    """The unsharded state dict (Hugging Face names, on every rank): shards are all-gathered and
    concatenated along their split dimension. Collective: every rank of `group` must call it."""
    dims = split_dims(model)
    return {k: _gather(v, dims[id(v)], group) if id(v) in dims else v.detach().clone()
            for k, v in model.state_dict(keep_vars=True).items()}


def full_grads(model: nn.Module, group=None) -> dict[str, torch.Tensor]:
    """Unsharded gradients by parameter name (Hugging Face names; collective), for parity checks."""
    dims = split_dims(model)
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        key = name.replace(".linear.weight", ".weight") if id(p) in dims and dims[id(p)] == 1 else name
        out[key] = (_gather(p.grad, dims[id(p)], group) if id(p) in dims else p.grad).clone()
    return out


def grad_norm(model: nn.Module, group=None) -> torch.Tensor:
    """The global L2 norm of the gradient: sharded parameters' squares summed over the TP group,
    replicated ones counted once."""
    dims = split_dims(model)
    sharded, replicated = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    seen: set[int] = set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p.grad is None or id(p) in seen:  # a tied embedding/LM head counts once
                continue
            seen.add(id(p))
            sq = p.grad.detach().double().pow(2).sum()
            if hasattr(sq, "full_tensor"):  # an FSDP DTensor: the sum over its shards
                sq = sq.full_tensor()
            if id(p) in dims:
                sharded += sq
            else:
                replicated += sq
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(sharded, group=group)
    return (sharded + replicated).sqrt()
