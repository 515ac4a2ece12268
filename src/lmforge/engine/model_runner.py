"""`ModelRunner`: one scheduled step -> one `StepInputs` value -> one forward pass -> logits of the
sequences that sample.

All scheduled tokens (prefill chunks and decode tokens together) form one flat row (1, T) with their
positions. `prepare` turns the scheduled sequences into `StepInputs` (plain ints); `execute` runs
them: the attention backend, chosen once at construction (`attention.select_backend`), builds its
indices from the block tables once per step and does the rest inside each layer. `lm_head` runs only
on the last token of each sequence whose chunk reaches its end, and on the prompt positions of a
sequence that asked for prompt logprobs (`ScheduledSeq.prompt_positions`). Under tensor parallelism `run` first
hands the same `StepInputs` to the worker ranks (`workers`: the executor), which `execute` the same
forward on their shards. This module knows nothing about scheduling policy, sampling, text or
processes.

Shape legend: T flat tokens this step, S sequences that sample, D hidden, V vocabulary.
"""

from __future__ import annotations

import os
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from lmforge.model import Transformer
from lmforge.quant.linear import QmmLinear, QuantizedLinear, store_layer_panels, swap_backend
from lmforge.quant.linear import select_backend as select_linear_backend

from . import decode_layer, hugepages, kernels
from .attention import kv_bytes_per_token, kv_store_dtype, select_backend
from .fused import fuse_elementwise, fuse_projections
from .scheduler import ScheduledSeq


@dataclass
class StepInputs:
    """What every rank needs for one forward: plain ints, cheap to pickle. Sequence s computes tokens
    [computed[s], computed[s] + q_lens[s]); `last_rows` are the flat rows whose logits rank 0 samples,
    `prompt_rows` those whose logits give prompt logprobs (their logits follow the sampled rows')."""
    input_ids: list[int]
    positions: list[int]
    last_rows: list[int]
    block_tables: list[list[int]]
    computed: list[int]
    q_lens: list[int]
    prompt_rows: list[int] = field(default_factory=list)
    pool_rows: list[int] = field(default_factory=list)  # pooling requests' last rows: their hidden states are kept


class StepWorkers(Protocol):
    """The other tensor-parallel ranks, as the runner sees them (`executor.MultiprocExecutor`)."""

    def send(self, inputs: StepInputs) -> None: ...

    def guard(self) -> AbstractContextManager: ...


def local_heads(model: Transformer) -> tuple[int, int]:
    """(query heads, kv heads) this process computes and caches: all of them, or one tensor-parallel
    rank's share (`executor.shard_model` divides them)."""
    attn = model.model.layers[0].self_attn
    return attn.n_heads, attn.n_kv_heads


def kv_bytes_per_block(model: Transformer, block_size: int, kv_cache_dtype: str = "auto") -> int:
    """2 (k and v) x layers x kv heads x head dim x block size x dtype size (int8: codes + a scale per head);
    under tensor parallelism, one rank's kv heads."""
    c = model.config
    dtype = kv_store_dtype(kv_cache_dtype, next(model.parameters()).dtype)
    return block_size * kv_bytes_per_token(c.num_hidden_layers, local_heads(model)[1], c.head_dim, dtype,
                                           kv_cache_dtype == "int8")


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer the model holds (a tied lm_head counted once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


class PackedLinear(nn.Module):
    """A bfloat16 or float32 `nn.Linear` whose weight oneDNN reordered once into its blocked layout. A
    plain bf16 `F.linear` on CPU reorders the weight on every call: at the few rows of a decode step that
    copy is a large part of the cost (a 512x1376 projection at 1 row: 156 us plain, 107 us packed;
    at 128 rows 378 vs 299 us; same bits). float32 `F.linear` (MKL) is slow at a decode step's few rows
    for another reason: the 8192x512 lm_head at 8 rows 2,581 us plain, 909 packed, 512x1376 187 vs 127
    (AVX2 EPYC, 2 threads; at 1 row MKL's GEMV wins on a cached layer-sized matrix, 0.6-1.0x, but a whole
    batch-1 engine step measured the same either way). `lmforge bench linear --no-quant --threads 2`
    reproduces both. Inference only: the original weight is not kept."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(w, 64), persistent=False)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def can_pack_linear(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packed linear on CPU: float32 wherever oneDNN runs, bf16 where the CPU computes it natively
    (AVX512-BF16 / AMX)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linear_weights(model: nn.Module) -> int:
    """Replace every `nn.Linear` of `model` by a `PackedLinear` (a tied lm_head gets its own packed
    copy; the embedding keeps the plain weight). Returns how many were packed."""
    todo = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if isinstance(child, nn.Linear)]
    for parent, name, child in todo:
        setattr(parent, name, PackedLinear(child))
    return len(todo)


def float32_except_linears(model: nn.Module) -> None:
    """In place: every floating-point parameter and buffer to float32 except the weights of `nn.Linear`
    layers (embedding, norms, rotary tables; a tied lm_head shares the embedding's and is widened with
    it). The first half of a bf16 checkpoint's float32-activation form on a CPU without bf16 units; the
    runner then swaps the bf16 linears for `QmmLinear.from_bf16` (`bf16_weights`)."""
    keep = ({id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
            - {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)})
    for t in list(model.parameters()) + list(model.buffers()):  # each shared tensor once
        if t.is_floating_point() and t.dtype != torch.float32 and id(t) not in keep:
            t.data = t.data.float()


def swap_bf16_linears(model: nn.Module, qmm, c_gemm: bool = False, bf16_units: bool = False,
                      bf16_panel: tuple | None = None) -> int:
    """Every `nn.Linear` with a bfloat16 weight becomes `QmmLinear.from_bf16` (bf16 weights, float32
    activations, `lmf_qmm_f32` with bits 16; prefill chunks on `lmf_gemm_f32` with `c_gemm`; with `bf16_units`
    many rows on the CPU's bf16 units: `bf16_panel` (`lmf_gemm_bf16`, from how many rows) or else oneDNN's bf16
    GEMM from `QmmLinear.BF16_UNITS_ROWS` rows); returns how many."""
    todo = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if type(child) is nn.Linear and child.weight.dtype == torch.bfloat16]
    for parent, name, child in todo:
        setattr(parent, name, QmmLinear.from_bf16(child, qmm, c_gemm, bf16_units, bf16_panel))
    return len(todo)


F32_QMM_ROWS = 16  # float32 weights up to here on lmf_qmm_f32 (bits 32): at or near oneDNN's packed speed (AVX2 EPYC)


def swap_f32_layer_linears(model: nn.Module, qmm, c_gemm: bool = False) -> int:
    """Every float32 `nn.Linear` inside the decoder layers becomes `QmmLinear.from_f32` (the weight itself,
    `lmf_qmm_f32` with bits 32 up to `F32_QMM_ROWS` rows; above, with `c_gemm` the same call (the panel GEMM
    `lmf_gemm_f32` from 10 rows), else oneDNN's GEMM on the same tensor), so that a
    decode step of a few rows runs each layer as one C call (`engine.decode_layer`); the LM head stays for
    `PackedLinear`.
    Returns how many."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    todo = [(parent, name, child) for layer in layers for parent in layer.modules()
            for name, child in parent.named_children()
            if type(child) is nn.Linear and child.weight.dtype == torch.float32]
    for parent, name, child in todo:
        setattr(parent, name, QmmLinear.from_f32(child, qmm, F32_QMM_ROWS, c_gemm))
    return len(todo)


def linear_backend(model: nn.Module, device: torch.device, reference: bool, lib: kernels.CpuKernels | None,
                   quant_activations: str = "none"):
    """The backend every quantized linear of `model` runs on (`lmforge.quant.linear.select_backend`) with
    this library's kernels: the exact float32-activation matmul, or with `quant_activations="int8"` the
    int8-activation one, whose prefill rows take a bf16 GEMM on a CPU with bf16 units."""
    a8 = lib.a8() if lib is not None and quant_activations == "int8" else None
    return select_linear_backend(model, device, reference, qmm=getattr(lib, "qmm_f32", None),
                                 quant_activations=quant_activations, a8=a8,
                                 prefill_bf16=a8 is not None and kernels.cpu_has_bf16(), c_gemm=gemm_on(lib))


def gemm_on(lib: kernels.CpuKernels | None) -> bool:
    """Whether prefill rows on float32 activations take `lmf_gemm_f32` (this build has its AVX2 + FMA body;
    `LMFORGE_GEMM=0` keeps the old paths, for A/B runs)."""
    return bool(lib is not None and lib.gemm_ok and os.environ.get("LMFORGE_GEMM", "1") != "0")


class ModelRunner:
    """The mechanism of a step (nano-vllm's `ModelRunner`): the model, its engine-only module swaps and
    the attention backend with its KV pool; `attention_backend` names the backend for stats and logs."""

    workers: StepWorkers | None = None  # tensor parallelism: ranks 1.. get every step's inputs first
    pooled_PD: torch.Tensor | None = None  # the last step's final hidden states of `StepInputs.pool_rows` (float32)

    def __init__(self, model: Transformer, num_blocks: int, block_size: int, reference: bool = False,
                 pack_weights: bool = True, cpu_kernels: bool = True, kv_cache_dtype: str = "auto",
                 quant_activations: str = "none", fuse_projections: bool = False, bf16_weights: bool = False):
        self.model = model.eval()
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        lib = None
        if cpu_kernels and not reference and p.device.type == "cpu" and p.dtype in (torch.bfloat16, torch.float32):
            lib = kernels.load()  # None without a compiler: the torch path, same contract
        if bf16_weights and (lib is None or lib.qmm_f32 is None or reference):
            raise ValueError("bf16_weights needs lmforge's compiled CPU kernels and the fast attention")
        self._swap_modules(lib, reference, pack_weights, quant_activations, fuse_projections, bf16_weights)
        c = model.config
        n_heads, n_kv_heads = local_heads(model)
        self.attn = select_backend(c.num_hidden_layers, num_blocks, block_size, n_heads, n_kv_heads, c.head_dim,
                                   p.dtype, p.device, reference, lib, kv_cache_dtype, self.rounded_activations)
        self.attention_backend = self.attn.name
        # all-decode steps on float32 activations (int8/int4, bf16 or float32 weights): a layer a C call
        # (engine.decode_layer); not where the linears are wrapped later (LoRA) or sharded (tensor parallel): the
        # same cases that keep q/k/v and gate/up apart (`fuse_projections` False)
        self.decode_layers, self.decode_layers_why = (
            (0, "reference mode") if reference else
            (0, "LoRA or tensor parallelism wraps the linears") if not fuse_projections else
            decode_layer.install(model, self.attn, lib))
        self.timings = {"prepare": 0.0, "forward": 0.0}  # seconds, cumulative

    def _swap_modules(self, lib: kernels.CpuKernels | None, reference: bool, pack_weights: bool,
                      quant_activations: str = "none", fuse: bool = False, bf16_weights: bool = False) -> None:
        """The engine-only stand-ins, in order: q/k/v and gate/up concatenated (`fuse`, on a quantized or
        packed model, whose weights are already the engine's own copies: `LLM.load_weights` refuses both),
        one linear backend for every quantized layer, chosen once (`lmforge.quant.linear`; on float32
        activations the compiled int8/int4 matmul when the library has it), bf16 linears on float32
        activations (`bf16_weights`: `float32_except_linears` ran at load), oneDNN-packed bf16 linears,
        the fused elementwise modules; on a float32 model with the kernels, the decoder layers' (fused)
        linears on `lmf_qmm_f32` with bits 32 (`swap_f32_layer_linears`) and the rest packed."""
        model, device, dtype = self.model, self.device, self.dtype
        will_pack = pack_weights and not reference and can_pack_linear(device, dtype)
        quantized = any(isinstance(m, QuantizedLinear) for m in model.modules())
        self.fused_projections = 0
        if fuse and lib is not None and (quantized or will_pack or bf16_weights):
            with torch.no_grad():
                self.fused_projections = fuse_projections(model)
        backend = linear_backend(model, device, reference, lib, quant_activations)
        self.linear_backend = backend.name if backend is not None else "dense"
        self.quantized_linears = swap_backend(model, backend, dtype) if backend is not None else 0
        c_gemm = gemm_on(lib)
        bf16_units = kernels.cpu_has_bf16()
        # many rows of bf16 weights on the CPU's bf16 units: lmforge's bf16 panel GEMM (AVX512-BF16) from its
        # threshold, else oneDNN's bf16 GEMM
        bf16_panel = lib.bf16_panel_rows(-1) if bf16_units and lib is not None and lib.bf16_panel_rows else 0
        self.bf16_linears = (swap_bf16_linears(model, lib.qmm_f32, c_gemm, bf16_units,
                                               (lib.gemm_bf16, bf16_panel) if bf16_panel else None)
                             if bf16_weights else 0)
        # whether the linears round their activations (bf16 panel GEMM, int8 activations) before multiplying
        self.rounded_activations = bool(self.bf16_linears and bf16_panel) or bool(
            self.quantized_linears and quant_activations == "int8")
        if self.bf16_linears:
            self.linear_backend = ("bf16 weights x float32 activations (lmforge lmf_qmm_f32, bits 16; " + (
                f"from {bf16_panel} rows its bf16 panel GEMM on the CPU's bf16 units)" if bf16_panel else
                f"from {QmmLinear.BF16_UNITS_ROWS} rows oneDNN bf16 GEMM on the CPU's bf16 units)" if bf16_units else
                f"prefill on lmf_gemm_f32 from {QmmLinear.GEMM_MIN_ROWS[16]} rows)" if c_gemm else
                "widen + sgemm above 32 rows)"))
        # once both swaps are done: int4 / int8 and bf16 layers alike
        self.panel_linears = store_layer_panels(model) if self.quantized_linears or self.bf16_linears else 0
        if self.panel_linears:
            kinds = "bf16" if self.bf16_linears and not self.quantized_linears else "int4/int8"
            self.linear_backend += f"; {self.panel_linears} {kinds} linears stored as 16-row panels"
        # the integer and bf16 weights in transparent huge pages, before the C decoder layers record their addresses
        self.hugepage_bytes = hugepages.place_linears(model)
        self.weight_bytes = weight_bytes(model)
        # every weight under its checkpoint name, captured before any swap below: the fused stand-ins
        # hold these same tensors (not copies), so `load_weights` can write through them in place
        self.named_weights = dict(model.state_dict()) if not (self.quantized_linears or self.bf16_linears) else {}
        self.f32_layer_linears = 0
        if (will_pack and dtype == torch.float32 and lib is not None and self.fused_projections and not quantized
                and not bf16_weights and os.environ.get("LMFORGE_F32_DECODE_LAYERS", "1") != "0"):
            self.f32_layer_linears = swap_f32_layer_linears(model, lib.qmm_f32, c_gemm)
        if self.f32_layer_linears:
            above = f"lmforge lmf_gemm_f32 from {QmmLinear.GEMM_MIN_ROWS[32]} rows" if c_gemm else f"oneDNN GEMM above {F32_QMM_ROWS} rows"
            self.linear_backend = f"float32 layers on lmforge lmf_qmm_f32 (bits 32), {above}; the LM head oneDNN-packed"
        self.packed_linears = 0
        if will_pack:
            with torch.no_grad():
                self.packed_linears = pack_linear_weights(model)
        self.fused_modules = fuse_elementwise(model, lib) if lib is not None else 0

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """float32 (float64 in exactness mode) logits (S + P, V): one row per sampling sequence (1 + its drafts'
        rows for a verifying one), in `scheduled` order, then the P prompt-logprob rows in the same order.
        Adds its seconds to `timings` (on CUDA, `forward` is launch time: the sampler's copy waits for the rest)."""
        t0 = time.perf_counter()
        inputs = self.prepare(scheduled)
        if self.workers is None:
            return self.execute(inputs, t0=t0)
        self.workers.send(inputs)
        with self.workers.guard():  # a failed all-reduce whose peer died says which rank
            return self.execute(inputs, t0=t0)

    @staticmethod
    def prepare(scheduled: list[ScheduledSeq]) -> StepInputs:
        """The step as plain ints: what every tensor-parallel rank needs to run the same forward."""
        input_ids, positions, last_rows, start = [], [], [], 0
        tables, computed, q_lens, prompt_rows, pool_rows = [], [], [], [], []
        for s in scheduled:  # a verifying sequence: its last token, then its drafts, all K+1 rows sampled
            c, n, k = s.seq.num_computed_tokens, s.num_new_tokens, len(s.spec_token_ids)
            input_ids += s.seq.token_ids[c:c + n - k] + s.spec_token_ids
            positions += range(c, c + n)
            prompt_rows += (start + p - c for p in s.prompt_positions)
            start += n
            if s.samples and s.seq.pooling is not None:
                pool_rows.append(start - 1)
            elif s.samples:
                last_rows += range(start - 1 - k, start)
            # the attention sees a verification's K+1 rows as K+1 one-token decodes of the same block table
            # (every backend writes a step's K/V before it attends): the decode path, and its rounding
            parts = n if k else 1
            tables += [s.seq.block_table] * parts
            computed += range(c, c + parts) if k else [c]
            q_lens += [1] * parts if k else [n]
        return StepInputs(input_ids, positions, last_rows, tables, computed, q_lens, prompt_rows, pool_rows)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, logits: bool = True, t0: float | None = None) -> torch.Tensor | None:
        """One forward; the logits of `inputs.last_rows`, then of `inputs.prompt_rows` (tensor-parallel
        workers pass `logits=False`)."""
        t0 = time.perf_counter() if t0 is None else t0
        self.attn.prepare(inputs.block_tables, inputs.computed, inputs.q_lens)
        to_dev = dict(dtype=torch.long, device=self.device)
        input_ids_1T = torch.tensor([inputs.input_ids], **to_dev)
        positions_1T = torch.tensor([inputs.positions], **to_dev)
        last_rows_S = torch.tensor(inputs.last_rows + inputs.prompt_rows, **to_dev)
        t1 = time.perf_counter()
        h_1TD = self.model.hidden_states(input_ids_1T, positions_1T, attn=self.attn)
        self.attn.finish()
        self.pooled_PD = h_1TD[0, inputs.pool_rows].float() if inputs.pool_rows else None
        if not logits:
            logits_SV = None
        elif inputs.last_rows or inputs.prompt_rows:
            logits_SV = self.model.lm_head(h_1TD[0, last_rows_S]).to(torch.promote_types(self.dtype, torch.float32))
        else:  # float64 stays exact
            logits_SV = torch.empty(0, self.model.config.vocab_size, device=self.device)
        self.timings["prepare"] += t1 - t0
        self.timings["forward"] += time.perf_counter() - t1
        return logits_SV
