"""The training stage's typed config: sections `run`, `data`, `model`, `train` (with
`train.parallel`), `lora`, `sft`, `grpo`, `dpo`.

Loaded with `lmforge.config.load_config(TrainConfig, path, ["train.lr=3e-4", ...])`, validated
once in `TrainConfig.validate()`, and saved resolved as the run's `config.yaml`. The `model`
section either describes a fresh model (Hugging Face field names; `vocab_size: null` takes the
packed data's vocabulary, `max_position_embeddings: null` the sequence length) or names a
Hugging Face directory to start from (`model.init`). It knows nothing about tensors.

    from lmforge.config import load_config
    cfg = load_config(TrainConfig, "configs/tiny.yaml", ["train.max_steps=10"])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from lmforge.config import ConfigError

from .grpo.config import GRPOSection


@dataclass
class RunSection:
    name: str | None = None  # experiment id in record.json; None = the --out folder's name
    out: str | None = None  # run directory when --out is not given; None = runs/<config name>


@dataclass
class DataSection:
    path: str | None = None  # pretrain: packed dir (`lmforge data pack`); sft: chat JSONL
    val_path: str | None = None  # sft only: chat JSONL to evaluate on (pretrain uses the packed val split)
    tokenizer: str | None = None  # tokenizer dir; None = the one the packed data was made with


@dataclass
class ModelSection:
    init: str | None = None  # HF-layout directory to start from; the fields below are then ignored
    model_type: str = "llama"
    vocab_size: int | None = None  # None = the packed data's vocabulary
    hidden_size: int = 256
    intermediate_size: int = 704
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int | None = None  # None = the training sequence length
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02


@dataclass
class ParallelSection:
    """Model parallelism under torchrun (`lmforge.parallel`); data parallelism is what is left:
    world size / tp ranks, DDP or (fsdp) FSDP over them. With pp > 1 every process is one pipeline
    stage (world size = pp) and each batch is cut into `microbatches`."""

    tp: int = 1  # tensor-parallel degree (Megatron column/row split of attention and MLP)
    fsdp: bool = False  # shard parameters, gradients and optimizer state (fully_shard) over the data ranks
    pp: int = 1  # pipeline stages (consecutive layers per process)
    microbatches: int = 1  # pipeline micro-batches per batch (must divide train.batch_size)
    schedule: Literal["gpipe", "1f1b"] = "1f1b"

    @property
    def active(self) -> bool:
        return self.tp > 1 or self.fsdp or self.pp > 1


@dataclass
class TrainSection:
    stage: Literal["pretrain", "sft", "grpo", "dpo"] = "pretrain"  # grpo: train/grpo/; dpo: train/dpo.py
    method: Literal["full", "lora"] = "full"
    max_steps: int = 100
    batch_size: int = 8  # sequences per micro-batch per process
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio
    warmup_steps: int = 10
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: float = 0.1
    embedding_lr: float | None = None  # token embedding's AdamW learning rate; None = lr
    head_lr: float | None = None  # untied LM head's AdamW learning rate; None = lr
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 = no clipping (the norm is still measured and logged)
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    device: str = "auto"
    seed: int = 0
    ckpt_every: int = 100  # 0 = only at the end
    keep_last: int = 2  # checkpoints kept besides the best one
    eval_every: int = 50  # 0 = only at the end
    eval_batches: int = 8  # 0 = pretrain: every val row once (sft: one batch)
    target_val_loss: float | None = None  # report the first step/seconds/tokens at which val_loss <= this
    log_every: int = 1  # console lines; metrics.jsonl gets every step
    gradient_checkpointing: bool = False
    compile: bool = False
    fused_loss: bool = True  # LM head + cross-entropy in chunks of tokens, no full logits (fused_ce.py)
    seq_len: int = 256  # sft only: rendered chats are packed/padded to this (pretrain: the data's)
    preflight: bool = True  # refuse before allocating when the memory estimate exceeds the free memory
    deterministic: bool = False  # deterministic kernels + cuDNN flags + CUBLAS_WORKSPACE_CONFIG, recorded
    spike_zscore: float = 6.0  # warn when loss/grad_norm exceeds the trailing mean by this many std; 0 = off
    skip_spikes: bool = False  # also skip the optimizer update of such a batch
    parallel: ParallelSection = field(default_factory=ParallelSection)  # train.parallel.tp=2 under torchrun


# nn.Linear names in the model (Hugging Face's), the only modules adapters can target.
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


@dataclass
class LoraConfig:
    """LoRA hyper-parameters; `alpha / rank` scales the update (Hu et al. 2021, section 4.1)."""

    rank: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    base_dtype: str = "float32"  # frozen base linears: float32 | bfloat16 | auto (bf16 where the device has it)
    base_quant: str | None = None  # None | int8 | int4: QLoRA-style frozen quantized base (lmforge.train.lora)

    def validate(self, model: Any) -> None:
        """Every rule; `model` (a `Transformer`) is needed only for the tied-head one."""
        if self.base_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"lora config: base_dtype must be auto, float32 or bfloat16, got {self.base_dtype!r}")
        if self.base_quant not in (None, "none", "int8", "int4"):
            raise ValueError(f"lora config: base_quant must be null, int8 or int4, got {self.base_quant!r}")
        if self.rank < 1:
            raise ValueError(f"lora config: rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"lora config: alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora config: dropout must be in [0, 1), got {self.dropout}")
        unknown = [m for m in self.target_modules if m not in LINEAR_MODULES]
        if not self.target_modules or unknown:
            raise ValueError(f"lora config: target_modules {unknown or '[]'} not valid; choose from "
                             f"{', '.join(LINEAR_MODULES)}")
        if "lm_head" in self.target_modules and model.config.tie_word_embeddings:
            # merging would also change the tied input embedding, which LoRA never saw
            raise ValueError("lora config: target_modules has lm_head but the model ties it to "
                             "embed_tokens (tie_word_embeddings=True); drop lm_head")


@dataclass
class SFTSection:
    packed: bool = True  # pack several chats per row (masked per document) or pad one per row


@dataclass
class DPOSection:
    """Direct preference optimisation (Rafailov et al. 2023) on `data.path` preference pairs (train/dpo.py)."""

    beta: float = 0.1  # sigmoid: scale of the implicit reward; ipo: the regulariser tau (TRL's beta)
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"  # ipo: Azar et al. 2023, log-ratios averaged per token
    precompute_ref_log_probs: bool = False  # reference log-probs of every pair once at the start, then no reference
    rpo_alpha: float = 0.0  # > 0: + alpha * the chosen completion's NLL per token (RPO; TRL's rpo_alpha)

    def validate(self) -> None:
        if self.beta <= 0:
            raise ConfigError(f"dpo.beta must be > 0, got {self.beta}")
        if self.rpo_alpha < 0:
            raise ConfigError(f"dpo.rpo_alpha must be >= 0, got {self.rpo_alpha}")
        if self.loss_type not in ("sigmoid", "ipo"):
            raise ConfigError(f"dpo.loss_type must be sigmoid or ipo, got {self.loss_type!r}")


@dataclass
class TrainConfig:
    run: RunSection = field(default_factory=RunSection)
    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    train: TrainSection = field(default_factory=TrainSection)
    lora: LoraConfig = field(default_factory=LoraConfig)
    sft: SFTSection = field(default_factory=SFTSection)
    grpo: GRPOSection = field(default_factory=GRPOSection)
    dpo: DPOSection = field(default_factory=DPOSection)

    def validate(self) -> TrainConfig:
        t = self.train
        if not self.data.path:
            hint = {"pretrain": "a packed dir from `lmforge data pack`", "dpo": "a preference JSONL file (e.g. "
                    "`lmforge flywheel build`'s preferences.jsonl)"}.get(t.stage, "a chat JSONL file")
            raise ConfigError(f"data.path is required: {hint} (e.g. data.path=runs/packed)")
        if t.stage == "grpo":
            if not self.model.init or t.method != "full":
                raise ConfigError("grpo needs model.init=MODEL_DIR (an HF folder with a chat template, e.g. an "
                                  "exported SFT run) and train.method=full")
            self.grpo.validate()
        if t.stage == "dpo":
            if not self.model.init:
                raise ConfigError("dpo needs model.init=MODEL_DIR (an HF folder with a tokenizer and chat template, "
                                  "e.g. an exported SFT run): it is the policy's start and the frozen reference")
            if t.parallel.active:
                raise ConfigError("dpo runs on one process or under torchrun with DDP; train.parallel (tp, pp, "
                                  "fsdp) is not supported for it")
            self.dpo.validate()
        if t.stage == "sft" and not (self.data.tokenizer or self.model.init):
            raise ConfigError("sft needs a tokenizer: set data.tokenizer=DIR (or model.init to a dir holding one)")
        for key in ("max_steps", "batch_size", "grad_accum", "seq_len"):
            if getattr(t, key) < 1:
                raise ConfigError(f"train.{key} must be >= 1, got {getattr(t, key)}")
        for key in ("ckpt_every", "eval_every", "eval_batches", "warmup_steps", "keep_last", "log_every"):
            if getattr(t, key) < 0:
                raise ConfigError(f"train.{key} must be >= 0, got {getattr(t, key)}")
        for key in ("lr", "embedding_lr", "head_lr"):
            if getattr(t, key) is not None and getattr(t, key) <= 0:
                raise ConfigError(f"train.{key} must be > 0, got {getattr(t, key)}")
        if t.target_val_loss is not None and t.target_val_loss <= 0:
            raise ConfigError(f"train.target_val_loss must be > 0 (nats/token) or null, got {t.target_val_loss}")
        if not 0 <= t.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
        for key in ("tp", "pp", "microbatches"):
            if getattr(t.parallel, key) < 1:
                raise ConfigError(f"train.parallel.{key} must be >= 1, got {getattr(t.parallel, key)}")
        if t.batch_size % t.parallel.microbatches:
            raise ConfigError(f"train.parallel.microbatches={t.parallel.microbatches} must divide "
                              f"train.batch_size={t.batch_size}")
        if t.method == "lora" and (self.lora.rank < 1 or not self.lora.target_modules):
            raise ConfigError("lora.rank must be >= 1 and lora.target_modules non-empty")
        return self
