"""`EngineConfig`: everything the inference engine is told, validated once.

Field names follow vLLM's engine arguments. This module knows nothing about tensors; the KV pool
size is resolved later by the model runner, which knows the model's shape and the device.
"""

from __future__ import annotations

from dataclasses import dataclass

KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8")


@dataclass
class EngineConfig:
    model: str  # a Hugging Face layout directory (config.json + *.safetensors [+ tokenizer files])
    dtype: str = "auto"  # auto (the checkpoint's) | float32 | bfloat16 | float16 | float64 (exactness mode)
    device: str = "auto"  # auto = cuda when present, else cpu
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # None = sized from kv_cache_memory_bytes
    kv_cache_memory_bytes: int | None = None  # None = 90% of free GPU memory, or a CPU default
    max_num_seqs: int = 128  # most sequences in one step
    max_num_batched_tokens: int = 2048  # the per-step token budget (prefill chunks + decode tokens)
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    enable_prefix_caching: bool = True
    seed: int = 0  # seeds torch for requests that set no seed of their own
    attention: str = "fast"  # fast (batched gather + SDPA) | reference (per-sequence loop, plain math)
    pack_weights: bool = True  # CPU float32 / bf16: linear weights reordered once into oneDNN's layout (fast path)
    cpu_kernels: bool = True  # CPU bfloat16: compiled C paged-decode attention (torch path if no compiler)
    # auto (the model's dtype; on CPU float32 activations over bf16 or int8-activation weights: bfloat16, see
    # LLMEngine._resolve_kv_dtype) | bfloat16 | float32 | int8 (codes + a bf16 scale per token per head)
    kv_cache_dtype: str = "auto"
    # int-weight checkpoints on CPU: auto (int8 where the CPU has VNNI or AVX2 integer dots, as llama.cpp) |
    # none (exact float32 activations) | int8 (int8 activations a scale per block of 32 or the weight group, integer dots)
    quant_activations: str = "auto"
    tensor_parallel_size: int = 1  # processes (ranks) the model's layers are split over (engine/executor.py)
    # speculative decoding (engine/spec_decode.py): a draft model, or ngram prompt lookup, proposes K tokens
    speculative_model: str | None = None  # the draft model's directory (same tokenizer); implies method "draft"
    num_speculative_tokens: int = 0  # K, tokens proposed per step; required (>= 1) with a method
    speculative_method: str | None = None  # None (off, unless speculative_model) | ngram | draft
    ngram_prompt_lookup_max: int = 4  # ngram: the longest suffix looked up in the sequence
    ngram_prompt_lookup_min: int = 2  # ngram: the shortest
    # multi-LoRA serving (engine/lora.py): requests pick peft adapters over this one base, batched together
    enable_lora: bool = False
    max_loras: int = 1  # adapters resident at once (slots); more are swapped in LRU between steps
    max_lora_rank: int = 16  # the largest adapter rank accepted (every slot is this wide)
    max_cpu_loras: int | None = None  # parsed adapters kept in memory (None: max_loras)

    def __post_init__(self) -> None:
        if self.speculative_model is not None and self.speculative_method is None:
            self.speculative_method = "draft"
        self._check()
        self._check_spec()
        self._check_lora()

    def _check(self) -> None:
        checks = [
            ("block_size", self.block_size >= 1, "must be >= 1"),
            ("num_kv_blocks", self.num_kv_blocks is None or self.num_kv_blocks >= 1, "must be >= 1"),
            ("kv_cache_memory_bytes", self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
             "must be > 0"),
            ("max_num_seqs", self.max_num_seqs >= 1, "must be >= 1"),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1, "must be >= 1"),
            ("max_model_len", self.max_model_len is None or self.max_model_len >= 1, "must be >= 1"),
            ("attention", self.attention in ("fast", "reference"), "must be 'fast' or 'reference'"),
            ("kv_cache_dtype", self.kv_cache_dtype in KV_CACHE_DTYPES, f"must be one of {', '.join(KV_CACHE_DTYPES)}"),
            ("quant_activations", self.quant_activations in ("auto", "none", "int8"), "must be 'auto', 'none' or 'int8'"),
            ("tensor_parallel_size", isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
             "must be an integer >= 1"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"EngineConfig.{name}={getattr(self, name)!r}: {why}")

    def _check_spec(self) -> None:
        m, k = self.speculative_method, self.num_speculative_tokens
        checks = [
            ("speculative_method", m in (None, "ngram", "draft"), "must be 'ngram' or 'draft' (or unset)"),
            ("speculative_model", (m == "draft") == (self.speculative_model is not None),
             "a draft model directory goes with speculative_method 'draft' and only with it"),
            ("num_speculative_tokens", isinstance(k, int) and (k >= 1 if m else k >= 0),
             "must be an integer >= 1 when speculative decoding is on"),
            ("ngram_prompt_lookup_min", 1 <= self.ngram_prompt_lookup_min <= self.ngram_prompt_lookup_max,
             "must be >= 1 and <= ngram_prompt_lookup_max"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"EngineConfig.{name}={getattr(self, name)!r}: {why}")

    def _check_lora(self) -> None:
        checks = [
            ("max_loras", isinstance(self.max_loras, int) and self.max_loras >= 1, "must be an integer >= 1"),
            ("max_lora_rank", isinstance(self.max_lora_rank, int) and self.max_lora_rank >= 1,
             "must be an integer >= 1"),
            ("max_cpu_loras", self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
             "must be >= max_loras (or unset)"),
            ("enable_lora", not self.enable_lora or self.tensor_parallel_size == 1,
             "LoRA serving runs with tensor_parallel_size 1 (the adapters are not sharded)"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"EngineConfig.{name}={getattr(self, name)!r}: {why}")


def kv_budget_for_utilization(fraction: float, *, cuda: bool, total_bytes: int, free_bytes: int, weights_bytes: int,
                              need_bytes: int) -> int:
    """vLLM's `--gpu-memory-utilization` as a KV pool budget in bytes (`kv_cache_memory_bytes`).

    CUDA (vLLM's meaning): this process may hold `fraction` of the GPU's total memory; the weights come
    out of it, and of the rest the pool takes 90%, leaving 10% for activations, as the engine's own
    default does with free memory. Refused (ValueError) when that share is not free now, as vLLM refuses.
    CPU: the pool gets `fraction` of the memory available now (`free_bytes`), but no more than `need_bytes`,
    what `max_num_seqs` sequences of full length can fill (a larger pool would only be zeroed memory)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"gpu_memory_utilization={fraction!r}: a share of memory in (0, 1], e.g. 0.9")
    if not cuda:
        return max(1, min(int(fraction * free_bytes), need_bytes))
    share = int(fraction * total_bytes)
    if share > free_bytes:
        raise ValueError(f"gpu_memory_utilization={fraction}: asks for {share / 2**30:.1f} GiB of the GPU's "
                         f"{total_bytes / 2**30:.1f} GiB, but {free_bytes / 2**30:.1f} GiB is free (another process "
                         f"holds the rest); lower it to {free_bytes / total_bytes:.2f} or less")
    left = share - weights_bytes
    if left <= 0:
        raise ValueError(f"gpu_memory_utilization={fraction}: {share / 2**30:.1f} GiB does not hold the weights "
                         f"({weights_bytes / 2**30:.1f} GiB); raise it")
    return int(0.9 * left)
