"""Multi-LoRA serving: many adapters over one base model, in one batch (Punica, Chen et al. 2023;
S-LoRA, Sheng et al. 2023; vLLM's `vllm/lora/`).

A request may name an adapter (`LoRARequest`: vLLM's `lora_name`, `lora_int_id`, `lora_path`); its
sequences then run every LoRA-targeted linear as `y = base(x) + scale * (x @ A^T) @ B^T` with their
own A and B, while the other rows of the same flat batch use other adapters or none. The base weights
are shared and never change; an adapter is a peft folder (`adapter_config.json` +
`adapter_model.safetensors`, what `peft` and `lmforge.train.lora_adapter` write).

How the batch is computed. Each targeted linear holds the resident adapters stacked side by side:
`lora_a` (in, S*R) and `lora_b` (S*R, out), S = `max_loras` slots of R = `max_lora_rank` columns, an
adapter of rank r < R zero-padded, its scale folded into B. A step computes `x @ lora_a` for all
slots at once (T, S*R), zeroes the columns that are not each token's own slot with a mask built once
per step (T, S*R; all zero for a row without adapter), and adds `(...) @ lora_b`: two small dense
matmuls and a multiply per linear, whatever the mix of adapters, with no gather of per-token weights
and no Python loop over requests or adapters (Punica's BGMV shrink/expand, computed densely: S*R is
small next to the hidden size). A step with no adapter rows skips all of it.

Slots. At most `max_loras` adapters are resident; a step that needs a non-resident one copies it into
a free slot, or evicts the least recently used slot that no running sequence uses (the scheduler
admits a sequence only while the running sequences use at most `max_loras` adapters, so such a slot
always exists). Adapters read from disk are kept (parsed, on CPU) for `max_cpu_loras` ids, LRU.

Prefix cache: the block hash chain starts from the adapter id (`block_manager.root_hash`), so two
adapters never share the K/V of the same prompt.

This module knows nothing about scheduling policy, sampling, text or HTTP.

Shape legend: T flat tokens this step, S slots, R max rank, r an adapter's rank, C = S*R columns.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from lmforge.model.checkpoint import read_hf_config
from lmforge.model.config import ModelConfig

# the linears an adapter may target, and where they live in a decoder layer
LORA_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
MAX_CONFIG_BYTES = 2**20  # peft's adapter_config.json is a few hundred bytes
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs with (vLLM's names). `lora_int_id` >= 1 identifies one loaded adapter:
    a folder loaded again under a new id is a new adapter (its own slot, its own prefix-cache chain)."""
    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass
class Adapter:
    """A peft folder, read and checked: per (layer, module) A (r, in) and scale * B (out, r), in float32."""
    name: str
    rank: int
    scale: float
    targets: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each LoRA-targetable linear of a decoder layer."""
    D, F, H = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * H, cfg.num_key_value_heads * H
    return {"q_proj": (D, q), "k_proj": (D, kv), "v_proj": (D, kv), "o_proj": (q, D),
            "gate_proj": (D, F), "up_proj": (D, F), "down_proj": (F, D)}


def read_adapter_config(path: str | Path, max_lora_rank: int) -> dict:
    """adapter_config.json, checked: a plain LoRA (no DoRA, bias, rank/alpha patterns or saved modules) of
    rank <= `max_lora_rank` over known modules. Raises ValueError naming the file, the field and the fix."""
    file = Path(path) / ADAPTER_CONFIG
    if not file.is_file():
        raise ValueError(f"{file}: not found; a LoRA adapter is a peft folder with {ADAPTER_CONFIG} and "
                         f"{ADAPTER_WEIGHTS} (`lmforge.train.lora_adapter.save_adapter`, or peft's save_pretrained)")
    try:
        if file.stat().st_size > MAX_CONFIG_BYTES:
            raise ValueError(f"{file.stat().st_size} bytes, more than an adapter config ever needs ({MAX_CONFIG_BYTES})")
        cfg = json.loads(file.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ValueError(f"{file}: not valid JSON ({_first_line(e)})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{file}: not a JSON object (peft writes {{\"r\": ..., \"target_modules\": ...}})")
    bad = {"peft_type": cfg.get("peft_type", "LORA") != "LORA", "use_dora": bool(cfg.get("use_dora")),
           "bias": cfg.get("bias", "none") != "none", "fan_in_fan_out": bool(cfg.get("fan_in_fan_out")),
           "rank_pattern": bool(cfg.get("rank_pattern")), "alpha_pattern": bool(cfg.get("alpha_pattern")),
           "modules_to_save": bool(cfg.get("modules_to_save"))}
    for name, is_bad in bad.items():
        if is_bad:
            raise ValueError(f"{file}: {name}={cfg.get(name)!r} is not served (plain LoRA only); retrain without "
                             f"it, or merge the adapter (lmforge export) and serve the merged model")
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        raise ValueError(f"{file}: r={r!r}: the rank must be an integer >= 1")
    if r > max_lora_rank:
        raise ValueError(f"{file}: r={r} is above --max-lora-rank {max_lora_rank}; restart with "
                         f"--max-lora-rank {r} or more")
    targets = cfg.get("target_modules")
    # a string is peft's regex over module paths, or "all-linear": what it matched shows in the tensor names,
    # which read_adapter checks one by one
    if targets is not None and not isinstance(targets, (str, list)):
        raise ValueError(f"{file}: target_modules must be a list of module names or a string, not "
                         f"{type(targets).__name__}")
    names = [targets] if isinstance(targets, str) else list(targets or [])
    unknown = [] if isinstance(targets, str) else [t for t in names if t not in LORA_MODULES]
    if not names or unknown:
        raise ValueError(f"{file}: target_modules {unknown or names!r} cannot be served; LoRA serving adapts "
                         f"{', '.join(LORA_MODULES)} (an lm_head or embedding adapter: merge it with lmforge export)")
    return cfg


def read_adapter(path: str | Path, model_cfg: ModelConfig, max_lora_rank: int, name: str = "") -> Adapter:
    """The adapter at `path`, every tensor checked against the base model's shapes."""
    path = Path(path)
    cfg = read_adapter_config(path, max_lora_rank)
    r, alpha = cfg["r"], cfg.get("lora_alpha", cfg["r"])
    scale = alpha / r ** 0.5 if cfg.get("use_rslora") else alpha / r  # rsLoRA: Kalajdzievski 2023
    file = path / ADAPTER_WEIGHTS
    if not file.is_file():
        raise ValueError(f"{file}: not found (only safetensors adapters are served; re-save with peft's "
                         f"save_pretrained(safe_serialization=True))")
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(file), framework="pt") as f:
            keys = list(f.keys())
            _check_shapes(file, {k: tuple(f.get_slice(k).get_shape()) for k in keys}, model_cfg, r)  # before loading
            for key in keys:
                m = _KEY.search(key)
                parts.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = f.get_tensor(key).float()
    except SafetensorError as e:  # zero bytes, truncated, a huge or garbled header: one line naming the file
        raise ValueError(f"{file}: not a readable safetensors file ({_first_line(e)}); re-save the adapter with "
                         "peft's save_pretrained") from None
    except OSError as e:
        raise ValueError(f"{file}: cannot be read ({type(e).__name__}: {e.strerror or e})") from None
    return Adapter(name or path.name, r, scale, tuple(sorted({m for _, m in parts})),
                   _checked_weights(file, parts, model_cfg, r, scale))


def _check_shapes(file: Path, shapes: dict[str, tuple[int, ...]], model_cfg: ModelConfig, r: int) -> None:
    """Every tensor's name and shape from the file's header, before a byte of weights is read: an adapter
    claiming huge tensors is refused without allocating them."""
    expected = module_shapes(model_cfg)
    for key, shape in shapes.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in LORA_MODULES:
            raise ValueError(f"{file}: tensor {key!r} is not a LoRA A/B weight of "
                             f"{', '.join(LORA_MODULES)}; it cannot be served")
        n_in, n_out = expected[m.group(2)]
        want = (r, n_in) if m.group(3) == "A" else (n_out, r)
        if shape != want:
            raise ValueError(f"{file}: layers.{m.group(1)}.{m.group(2)}: lora_{m.group(3)} is {shape}, not {want}: the "
                             f"tensors do not fit rank {r} over this base; another base model?")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def check_adapter(path: str | Path, model_dir: str | Path, max_lora_rank: int, name: str = "") -> Adapter:
    """`read_adapter` against the base model folder `model_dir` (its config.json): what a server checks
    before it serves an adapter."""
    return read_adapter(path, ModelConfig.from_hf(read_hf_config(Path(model_dir))), max_lora_rank, name)


def _checked_weights(file: Path, parts: dict, model_cfg: ModelConfig, r: int,
                     scale: float) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    shapes, out = module_shapes(model_cfg), {}
    for (layer, module), ab in sorted(parts.items()):
        where = f"{file}: layers.{layer}.{module}"
        if layer >= model_cfg.num_hidden_layers:
            raise ValueError(f"{where}: the base model has {model_cfg.num_hidden_layers} layers; "
                             f"this adapter was trained on another model")
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: lora_A and lora_B are both needed, found only lora_{''.join(ab)}")
        n_in, n_out = shapes[module]
        if tuple(ab["A"].shape) != (r, n_in) or tuple(ab["B"].shape) != (n_out, r):
            raise ValueError(f"{where}: lora_A {tuple(ab['A'].shape)} and lora_B {tuple(ab['B'].shape)} do not "
                             f"fit rank {r} over this base ({(r, n_in)} and {(n_out, r)}); another base model?")
        if not (torch.isfinite(ab["A"]).all() and torch.isfinite(ab["B"]).all()):
            raise ValueError(f"{where}: non-finite weights")
        out[(layer, module)] = (ab["A"], ab["B"] * scale)
    if not out:
        raise ValueError(f"{file}: no LoRA weights in it")
    return out


class LoRAStep:
    """What every LoRA linear reads in one step: the (T, C) column mask, or None (no adapter rows)."""
    mask_TC: torch.Tensor | None = None


class LoRALinear(nn.Module):
    """`base(x)` plus, per row, its own slot's `scale * (x A^T) B^T` (see the module docstring)."""

    def __init__(self, base: nn.Module, n_in: int, n_out: int, slots: int, max_rank: int, step: LoRAStep,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.base_layer, self.step, self.n_out, self.R = base, step, n_out, max_rank
        self.lora_a = torch.zeros(n_in, slots * max_rank, dtype=dtype, device=device)  # (in, C)
        self.lora_b = torch.zeros(slots * max_rank, n_out, dtype=dtype, device=device)  # (C, out)
        self.slots: set[int] = set()  # slots holding weights for this module: none -> skipped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        mask_TC = self.step.mask_TC
        if mask_TC is None or not self.slots:
            return y
        x_TI = x.reshape(-1, x.shape[-1])
        y_TO = y.reshape(-1, self.n_out)  # a fresh output: updated in place
        return y_TO.addmm_((x_TI @ self.lora_a) * mask_TC, self.lora_b).view_as(y)

    def set_slot(self, slot: int, rank: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Columns slot*R .. slot*R + R: this adapter's A^T and (scale B)^T, zero-padded; zero if `weights` is None."""
        R = self.R
        cols = slice(slot * R, (slot + 1) * R)
        self.lora_a[:, cols].zero_()
        self.lora_b[cols].zero_()
        if weights is None:
            self.slots.discard(slot)
            return
        a_rI, b_Or = weights
        self.lora_a[:, slot * R:slot * R + rank].copy_(a_rI.t())
        self.lora_b[slot * R:slot * R + rank].copy_(b_Or.t())
        self.slots.add(slot)


class LoRAManager:
    """The resident adapters of one model: `LoRALinear`s swapped in for every targetable linear, `max_loras`
    slots in LRU order, a CPU cache of parsed adapters; `activate` readies a step."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None = None):
        p = next(model.parameters())
        self.model_cfg: ModelConfig = model.config
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.step = LoRAStep()
        self.layers = self._install(model, p.dtype, p.device)
        self.dtype, self.device = p.dtype, p.device
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first
        self.requests: dict[int, LoRARequest] = {}
        self.cpu: OrderedDict[int, Adapter] = OrderedDict()
        self.col_slot_C = torch.arange(max_loras * max_lora_rank, device=p.device) // max_lora_rank
        self.num_loads = 0
        self.max_adapters_in_step = 0  # the most distinct adapters one step has run (stats: batching shows)

    def _install(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> dict[tuple[int, str], LoRALinear]:
        shapes, layers = module_shapes(self.model_cfg), {}
        for i, block in enumerate(model.model.layers):
            for name, parent in LORA_MODULES.items():
                owner = getattr(block, parent)
                lin = LoRALinear(getattr(owner, name), *shapes[name], self.max_loras, self.max_lora_rank, self.step,
                                 dtype, device)
                setattr(owner, name, lin)
                layers[(i, name)] = lin
        return layers

    def check(self, request: LoRARequest) -> None:
        """Read (or find cached) and check the request's adapter; ValueError naming the problem."""
        known = self.requests.get(request.lora_int_id)
        if known is not None and known != request:
            raise ValueError(f"lora_int_id {request.lora_int_id} is already {known.lora_name!r} at "
                             f"{known.lora_path}; give each loaded adapter its own id")
        if request.lora_int_id < 1:
            raise ValueError(f"LoRARequest {request.lora_name!r}: lora_int_id must be >= 1 (0 is the base model)")
        self._adapter(request)
        self.requests[request.lora_int_id] = request

    def _adapter(self, request: LoRARequest) -> Adapter:
        lid = request.lora_int_id
        if lid in self.cpu:
            self.cpu.move_to_end(lid)
            return self.cpu[lid]
        adapter = read_adapter(request.lora_path, self.model_cfg, self.max_lora_rank, request.lora_name)
        self.cpu[lid] = adapter
        while len(self.cpu) > self.max_cpu_loras:
            self.cpu.popitem(last=False)
        return adapter

    def activate(self, scheduled: list, running: list) -> None:
        """Make every adapter of `scheduled` resident (evicting only slots no running sequence uses) and
        build the step's (T, C) mask in the flat batch's order (`scheduled`, `num_new_tokens` rows each)."""
        ids = [s.seq.lora_int_id for s in scheduled]
        if not any(ids):
            self.step.mask_TC = None
            return
        in_use, step_ids = {s.lora_int_id for s in running} | set(ids), dict.fromkeys(i for i in ids if i)
        for lid in step_ids:
            self._resident(lid, in_use)
        self.max_adapters_in_step = max(self.max_adapters_in_step, len(step_ids))
        slot_T = [self.slot_of[lid] if lid else -1 for s, lid in zip(scheduled, ids) for _ in range(s.num_new_tokens)]
        slot_T1 = torch.tensor(slot_T, device=self.device)[:, None]
        self.step.mask_TC = (slot_T1 == self.col_slot_C).to(self.dtype)

    def _resident(self, lid: int, in_use: set[int]) -> None:
        if lid in self.slot_of:
            self.slot_of.move_to_end(lid)
            return
        free = set(range(self.max_loras)) - set(self.slot_of.values())
        if free:
            slot = min(free)
        else:  # the least recently used slot that no running sequence needs
            victim = next((v for v in self.slot_of if v not in in_use), None)
            if victim is None:
                raise RuntimeError(f"all {self.max_loras} LoRA slots are used by running sequences "
                                   f"(the scheduler should not have admitted this one)")
            slot = self.slot_of.pop(victim)
        adapter = self._adapter(self.requests[lid])
        with torch.no_grad():
            for key, lin in self.layers.items():
                w = adapter.weights.get(key)
                lin.set_slot(slot, adapter.rank, None if w is None else (w[0].to(self.dtype), w[1].to(self.dtype)))
        self.slot_of[lid] = slot
        self.num_loads += 1

    def stats(self) -> dict:
        return dict(lora_resident=len(self.slot_of), lora_slot_loads=self.num_loads,
                    lora_max_adapters_in_step=self.max_adapters_in_step)
