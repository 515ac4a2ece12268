"""`LLMEngine`: requests in, `RequestOutput`s out, one scheduler step at a time.

`step()` is schedule -> run -> sample -> postprocess -> outputs (a pooling request, `PoolingParams`, ends
after its prefill with its last token's hidden state instead) (with speculative decoding,
`spec_decode.py` proposes drafts first and verifies them where the sampler would sample). The engine owns what ends a
request other than stop strings (the detokenizer's): EOS (unless `ignore_eos`), `stop_token_ids`,
`max_tokens`, `min_tokens`, `max_model_len` and a completed grammar (structured outputs); and it
refuses, upfront, requests that could never fit or whose grammar does not compile. It knows nothing
about HTTP or threads (see `async_engine.py`) or about progress bars (`llm.py`).

    engine = LLMEngine(EngineConfig(model="path/to/hf-dir"))
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import operator
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lmforge.model import Transformer
from lmforge.model.checkpoint import resolve_device
from lmforge.quant import load_pretrained
from lmforge.quant.gguf_file import release_gguf
from lmforge.quant.load import checkpoint_info, is_gguf
from lmforge.tokenizer.load import load_tokenizer
from lmforge.tools.redact import describe

from . import kernels
from .block_manager import BlockManager
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .executor import MultiprocExecutor
from .lora import LoRAManager, LoRARequest
from .model_runner import ModelRunner, float32_except_linears, kv_bytes_per_block
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .pooling_params import PoolingParams
from .sampler import Sampler, SampleResult, make_generator, prompt_logprobs
from .sampling_params import SamplingParams, truncate_prompt
from .scheduler import ScheduledSeq, Scheduler
from .sequence import Sequence
from .spec_decode import SpecDecoder
from .structured import StructuredOutputManager

CPU_KV_CACHE_BYTES = 2 * 1024**3  # default pool cap on CPU, where memory is shared with everything

log = logging.getLogger("lmforge.engine")


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    output_kind: str = "cumulative"
    sent: list[tuple[int, int]] = field(default_factory=list)  # delta: (tokens, characters) sent per sample
    prompt_logprobs_sent: bool = False  # delta: the prompt logprobs went out with the first output


def _eos_token_ids(model_dir: Path, model: Transformer, tokenizer) -> set[int]:
    ids: set[int] = set()
    sources = [model.config.eos_token_id, getattr(tokenizer, "eos_token_id", None)]
    gen = model_dir / "generation_config.json"
    if gen.exists():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for s in sources:
        ids.update([s] if isinstance(s, int) else (s or []))
    return ids


@contextlib.contextmanager
def _one_thread():
    """torch on one thread for the block: a load is copies and reshapes of many small tensors, and torch's
    thread pool makes each wait for a second core that a busy machine (the server's own imports, beside) has
    not given it (torch.cat of three 0.5 MB uint8 tensors: 16-24 ms on 2 threads with the other core busy,
    0.02 ms on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS after a load: the loader's transient copies (unpacked codes,
    unpermuted rows) leave glibc's heap holding them otherwise (130 MB after SmolLM2-135M's GGUF, 40% of what
    the load grew the process by). A no-op where the C library has no malloc_trim."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


def _model_path(model: str) -> Path:
    """The model folder or GGUF file, or FileNotFoundError saying what is missing."""
    path = Path(model)
    if is_gguf(path) and not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    if not is_gguf(path) and not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: no config.json; pass a Hugging Face layout model directory or a .gguf file")
    return path


def _token_ids(prompt) -> list[int]:
    """Python ints from a list of ints (numpy's and torch's integers too); a bool or a float is refused."""
    try:
        if any(isinstance(t, bool) for t in prompt):
            raise TypeError
        return [operator.index(t) for t in prompt]
    except TypeError:
        raise ValueError("prompt token ids must be integers") from None


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        model_dir = _model_path(config.model)
        info = checkpoint_info(model_dir)  # (saved dtype, int weights), from the header: before any worker starts
        bf16_weights = self._resolve_dtype(config, info)
        self.quant_activations_choice = self._resolve_quant_activations(config, info[1])
        self.kv_choice = self._resolve_kv_dtype(config, info[1], bf16_weights)
        torch.manual_seed(config.seed)
        # tensor parallelism: the workers start loading now, beside rank 0 (this process)
        self.executor = MultiprocExecutor(config) if config.tensor_parallel_size > 1 else None
        try:
            with _one_thread():
                self.model = load_pretrained(model_dir, dtype="bfloat16" if bf16_weights else config.dtype,
                                             device=config.device)
            if bf16_weights:  # float32 activations: all but the linear weights widened now (no float32 copy of those)
                float32_except_linears(self.model)
            if self.executor is not None:
                self.executor.shard(self.model)
            self.tokenizer = load_tokenizer(model_dir, optional=True)
            release_gguf()  # weights and vocabulary are copied out: unmap the file
            mc = self.model.config
            self.max_model_len = min(config.max_model_len or mc.max_position_embeddings,
                                     mc.max_position_embeddings)
            self.eos_token_ids = _eos_token_ids(model_dir, self.model, self.tokenizer)
            num_blocks = config.num_kv_blocks or self._num_blocks_from_budget()
            self.model_runner = ModelRunner(self.model, num_blocks, config.block_size,
                                            config.attention == "reference", config.pack_weights,
                                            config.cpu_kernels, config.kv_cache_dtype, config.quant_activations,
                                            fuse_projections=self.executor is None and not config.enable_lora,
                                            bf16_weights=bf16_weights)
            if self.executor is not None:
                self.executor.start(num_blocks)
                self.model_runner.workers = self.executor
        except BaseException:  # no worker outlives a failed load
            self.shutdown()
            raise
        _return_freed_memory()
        # the attention backend says which allocation it reads fastest (one run of blocks per sequence)
        runs = config.attention == "fast" and self.model_runner.attn.contiguous_runs
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, runs)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.lora = LoRAManager(self.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras) \
            if config.enable_lora else None
        self.scheduler.max_loras = config.max_loras if config.enable_lora else None
        self.sampler = Sampler(sorted(self.eos_token_ids))
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        self.spec = SpecDecoder(config, num_blocks, self.vocab_size, self.sampler, self.max_model_len) \
            if config.speculative_method else None
        self.requests: dict[str, Request] = {}
        self.counters = dict(steps=0, tokens_processed=0, kv_util_sum=0.0)
        self.timings = dict.fromkeys(("propose", "schedule", "sample", "postprocess", "detokenize"), 0.0)  # seconds
        self._log_ready(model_dir, num_blocks)

    def _log_ready(self, model_dir: Path, num_blocks: int) -> None:
        """One line: what was chosen (dtype, weights, activations, K/V, attention, kernels) and why."""
        r, config = self.model_runner, self.config
        log.info("engine ready: %s, %s (%s) on %s; weights %.1f MiB (%.1f MiB in huge pages; linear: %s; "
                 "activations: %s, %s); %d KV blocks of %d tokens (%.1f MiB, %d B/token, %s K/V: %s, %d tokens); "
                 "attention: %s; %d packed linears, %d fused modules; kernels: %s",
                 model_dir, r.dtype, self.dtype_choice, r.device, r.weight_bytes / 2**20, r.hugepage_bytes / 2**20,
                 r.linear_backend, config.quant_activations, self.quant_activations_choice, num_blocks,
                 config.block_size,
                 num_blocks * r.attn.bytes_per_block / 2**20, r.attn.bytes_per_block // config.block_size,
                 config.kv_cache_dtype, self.kv_choice, num_blocks * config.block_size, r.attention_backend,
                 r.packed_linears, r.fused_modules, kernels.status() if config.cpu_kernels else "off")

    def _resolve_dtype(self, config: EngineConfig, info: tuple[str | None, bool]) -> bool:
        """`--dtype auto` on CPU: what is fast here (`kernels.auto_dtype`), written into `config.dtype` and
        `self.dtype_choice`; True when a bf16 checkpoint keeps bf16 linear weights on float32 activations."""
        self.dtype_choice, bf16_weights = "set by --dtype", False
        if config.dtype == "auto" and resolve_device(config.device).type == "cpu":
            config.dtype, self.dtype_choice, bf16_weights = kernels.auto_dtype(*info)
            if bf16_weights and (config.tensor_parallel_size > 1 or config.enable_lora
                                 or config.attention == "reference"):  # those take one dtype throughout
                config.dtype, bf16_weights = "bfloat16", False
                self.dtype_choice = "bfloat16 checkpoint, CPU without bf16 units: bf16 (tensor parallel, LoRA or reference)"
        return bf16_weights

    @staticmethod
    def _resolve_quant_activations(config: EngineConfig, quantized: bool) -> str:
        """`--quant-activations auto`: int8 where integer dot products run (`kernels.auto_quant_activations`),
        written into `config.quant_activations`; returns why, for the log and `/metrics`."""
        if config.quant_activations != "auto":
            return "set by --quant-activations"
        dtype = config.dtype if config.dtype != "auto" else "float32"
        config.quant_activations, why = kernels.auto_quant_activations(
            quantized, dtype, resolve_device(config.device).type, config.attention == "fast" and config.cpu_kernels,
            config.tensor_parallel_size > 1)
        return why

    @staticmethod
    def _resolve_kv_dtype(config: EngineConfig, quantized: bool, bf16_weights: bool) -> str:
        """`--kv-cache-dtype auto`: the activations' dtype, except on CPU float32 activations that exist for
        the kernels' sake, over a bf16 checkpoint (`bf16_weights`) or int8-activation (A8) int weights:
        there K/V is kept in bfloat16, as the bf16 checkpoint itself would (and as llama.cpp keeps f16 K/V),
        and a decode step reads half the bytes (at 700 tokens of context the random 300M's float32 K/V is
        67 MB a step, more than its Q4_0 weights). The exact A16 path and float32 checkpoints keep float32.
        Written into `config.kv_cache_dtype`; returns why, for the log and `/metrics`."""
        if config.kv_cache_dtype != "auto":
            return "set by --kv-cache-dtype"
        if config.dtype != "float32" or resolve_device(config.device).type != "cpu":
            return "the activations' dtype"
        a8 = config.quant_activations == "int8" and quantized
        if (bf16_weights or a8) and config.cpu_kernels and config.attention == "fast" and kernels.load() is not None:
            config.kv_cache_dtype = "bfloat16"
            return ("bf16 checkpoint on float32 activations: bf16 K/V" if bf16_weights else
                    "int8 activations over int weights: bf16 K/V (as llama.cpp's f16 cache)")
        config.kv_cache_dtype = "float32"
        return "the activations' dtype"

    def _num_blocks_from_budget(self) -> int:
        per_block = kv_bytes_per_block(self.model, self.config.block_size, self.config.kv_cache_dtype)
        budget = self.config.kv_cache_memory_bytes
        if budget is None and self.model_runner_device().type == "cuda":
            budget = int(torch.cuda.mem_get_info()[0] * 0.9)
        if budget is None:  # CPU: enough for max_num_seqs full-length sequences, capped
            budget = min(CPU_KV_CACHE_BYTES, self.config.max_num_seqs * -(-self.max_model_len // self.config.block_size) * per_block)
        if budget < per_block:
            raise ValueError(f"KV cache budget {budget} bytes is below one block ({per_block} bytes); "
                             "raise kv_cache_memory_bytes or lower block_size")
        return budget // per_block

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done when the engine is collected or at exit)."""
        if self.executor is not None:
            self.executor.shutdown()

    def model_runner_device(self) -> torch.device:
        # the runner's: the engine's stand-ins hold buffers, and a model of codes may have no parameter left
        return self.model_runner.device if hasattr(self, "model_runner") else next(self.model.parameters()).device

    # ---- requests ----------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int],
                    sampling_params: SamplingParams | PoolingParams | None = None,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None) -> None:
        """Queue a request (on the LoRA adapter `lora_request`, if given); raises ValueError (naming the
        numbers) for one that could never be served. `PoolingParams`: the prompt's pooled hidden state
        (`RequestOutput.embedding`) instead of tokens."""
        pooling = sampling_params if isinstance(sampling_params, PoolingParams) else None
        params = SamplingParams(max_tokens=1, temperature=0, truncate_prompt_tokens=pooling.truncate_prompt_tokens,
                                output_kind="final_only") if pooling else sampling_params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._check_params(params)
        if lora_request is not None:
            if self.lora is None:
                raise ValueError(f"LoRA adapter {lora_request.lora_name!r}: this engine runs without LoRA; "
                                 "start it with enable_lora (lmforge serve --lora-modules / --enable-lora)")
            self.lora.check(lora_request)  # read and checked once (ValueError naming file and field)
        text, ids = self._tokenize(prompt)
        if params.truncate_prompt_tokens is not None:
            kept = truncate_prompt(ids, params.truncate_prompt_tokens, self.max_model_len)
            text, ids = (text if len(kept) == len(ids) else None), kept
        bad_words = self._bad_words_token_ids(params.bad_words) if params.bad_words else []
        max_tokens = params.max_tokens or self.max_model_len - len(ids)
        if len(ids) + max_tokens > self.max_model_len:
            raise ValueError(f"request {request_id!r}: prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) = "
                             f"{len(ids) + max_tokens} > max_model_len ({self.max_model_len})")
        bs, pool = self.config.block_size, self.block_manager.num_blocks
        if -(-(len(ids) + max_tokens) // bs) > pool:
            raise ValueError(f"request {request_id!r}: prompt ({len(ids)}) + max_tokens ({max_tokens}) tokens need "
                             f"{-(-(len(ids) + max_tokens) // bs)} KV blocks of {bs}, the pool has {pool}")
        device, now = self.model_runner_device(), arrival_time or time.time()
        seqs = [Sequence(request_id, i, ids, params, max_tokens, make_generator(params.seed, i, device), now)
                for i in range(params.n)]
        for seq in seqs:
            seq.wait_for = seqs[0] if seq.index else None  # n > 1: share sample 0's prompt blocks
            seq.lora_request = lora_request
            seq.bad_words_token_ids, seq.pooling = bad_words, pooling
            if self.tokenizer is not None:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params, ids)
            if params.structured_outputs is not None:  # compiled (and checked) once, cached; a copy per sample
                seq.grammar = self.structured.grammar_for(params.structured_outputs)
            self.scheduler.add(seq)
        self.requests[request_id] = Request(request_id, text, ids, seqs, params.output_kind,
                                            [(0, 0)] * params.n)

    def _check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids against the vocabulary; unsupported fields.
        A grammar that does not compile is refused when add_request compiles it, before anything is queued."""
        V = self.vocab_size
        if any(t >= V for t in params.stop_token_ids):  # they index the logits (min_tokens masks them)
            raise ValueError(f"SamplingParams.stop_token_ids={[t for t in params.stop_token_ids if t >= V][:5]}: "
                             f"token ids must be below the vocabulary size ({V})")
        if any(t >= V for t in params.allowed_token_ids or ()):
            raise ValueError(f"SamplingParams.allowed_token_ids={[t for t in params.allowed_token_ids if t >= V][:5]}: "
                             f"token ids must be below the vocabulary size ({V})")
        bad = [t for t in params.logit_bias or () if t >= V]
        if bad:
            raise ValueError(f"SamplingParams.logit_bias: token id {bad[0]} is not in the vocabulary "
                             f"(ids are 0..{V - 1})")
        if params.structured_outputs is not None:
            self.structured.check(params.structured_outputs)  # raises ValueError naming the problem

    def _bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """vLLM's encoding of `bad_words`: each word as it would start a text, and after a space when that
        gives a different first token and as many tokens (so "word" is banned at the start and mid-text)."""
        if self.tokenizer is None:
            raise ValueError(f"SamplingParams.bad_words: {self.config.model} has no tokenizer to encode them; "
                             "ban token ids with logit_bias instead")
        out = []
        for word in bad_words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            out += [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])
        return [w for w in out if w and all(t < self.vocab_size for t in w)]

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.config.model} has no tokenizer files; pass prompts as lists of token ids")
            ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            ids, text = _token_ids(prompt), None
            V = self.model.config.vocab_size
            if any(not 0 <= t < V for t in ids):
                raise ValueError(f"prompt token ids must be in [0, {V}): got {[t for t in ids if not 0 <= t < V][:5]}")
        if not ids:
            raise ValueError("empty prompt: at least one token is needed")
        return text, ids

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now and free its blocks; returns its final output (None if unknown)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if seq.detokenizer is not None and seq.detokenizer.lazy and not seq.is_finished:
                seq.output_text += seq.detokenizer.catch_up()
            self.scheduler.finish(seq, "abort")
            if self.spec is not None:
                self.spec.release(seq)
        return self._output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step ----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """[propose ->] schedule -> run -> sample -> postprocess; each phase adds its seconds to `timings`."""
        if self.spec is not None:
            t0 = time.perf_counter()
            self.spec.propose(self.scheduler.running)  # drafts for the decoding sequences, verified this step
            self.timings["propose"] += time.perf_counter() - t0
        scheduled = self._schedule()
        if not scheduled:
            return self._idle()
        if self.lora is not None:  # adapters of this step resident, each row's slot known
            self.lora.activate(scheduled, self.scheduler.running)
        logits_SV = self._prompt_logprobs(scheduled, self.model_runner.run(scheduled))
        sampling, results = self._sample(scheduled, logits_SV)
        return self._update(scheduled, sampling, results)

    def _schedule(self) -> list[ScheduledSeq]:
        t0 = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if scheduled:  # an idle step is not counted
            self.timings["schedule"] += time.perf_counter() - t0
        return scheduled

    def _prompt_logprobs(self, scheduled: list[ScheduledSeq], logits: torch.Tensor) -> torch.Tensor:
        """Record the prompt logprobs of this step's prompt-logprob rows (they follow the sampled rows);
        returns the sampled rows' logits."""
        num_prompt_rows = sum(len(s.prompt_positions) for s in scheduled)
        if not num_prompt_rows:
            return logits
        t0, r = time.perf_counter(), logits.shape[0] - num_prompt_rows
        for s in scheduled:
            pos, seq = s.prompt_positions, s.seq
            if pos:
                targets = seq.prompt_token_ids[pos.start + 1:pos.stop + 1]  # position p predicts token p + 1
                seq.prompt_logprobs += prompt_logprobs(logits[r:r + len(pos)], targets,
                                                       seq.sampling_params.prompt_logprobs)
                r += len(pos)
        self.timings["sample"] += time.perf_counter() - t0
        return logits[:logits.shape[0] - num_prompt_rows]

    def _sample(self, scheduled: list[ScheduledSeq],
                logits_SV: torch.Tensor) -> tuple[list[Sequence], list[list[SampleResult]]]:
        """The sequences that sample this step (their chunk reached its end), and their new tokens: one
        each, or for a verifying sequence its accepted drafts and the target's token."""
        t0 = time.perf_counter()
        sampling = [s for s in scheduled if s.samples and s.seq.pooling is None]
        verifying = [s for s in sampling if s.spec_token_ids]
        plain = [s.seq for s in sampling if not s.spec_token_ids]
        if verifying:  # split the rows: one per plain sequence, K+1 per verifying one
            rows, spec_rows, r = [], [], 0
            for s in sampling:
                (spec_rows if s.spec_token_ids else rows).extend(range(r, r + 1 + len(s.spec_token_ids)))
                r += 1 + len(s.spec_token_ids)
            spec_SV, logits_SV = logits_SV[spec_rows], logits_SV[rows]
        banned_SV = self.structured.banned_tokens(plain, logits_SV.device) if plain else None
        results = iter(self.sampler(logits_SV, plain, banned_SV) if plain else [])
        kept = iter(self.spec.verify([s.seq for s in verifying], [s.spec_token_ids for s in verifying], spec_SV)
                    if verifying else [])
        tokens = [[SampleResult(t, None, None) for t in next(kept)] if s.spec_token_ids else [next(results)]
                  for s in sampling]
        self.timings["sample"] += time.perf_counter() - t0
        return [s.seq for s in sampling], tokens

    def _update(self, scheduled: list[ScheduledSeq], sampling: list[Sequence],
                results: list[list[SampleResult]]) -> list[RequestOutput]:
        """Advance the scheduler, count the step, append the tokens, end requests, build the outputs."""
        t0 = time.perf_counter()
        pooled = [s.seq for s in scheduled if s.samples and s.seq.pooling is not None]  # before `update` moves on
        self.scheduler.update(scheduled)
        self._count(scheduled)
        outputs = self._pooled(pooled) + self._postprocess(sampling, results)
        for s in scheduled:
            if s.spec_token_ids:
                self.scheduler.accept_spec(s.seq)
        self.timings["postprocess"] += time.perf_counter() - t0
        return outputs

    def _pooled(self, pooled: list[Sequence]) -> list[RequestOutput]:
        """Pooling requests whose prefill ended this step: their last token's hidden state (L2-normalized unless
        asked otherwise), and they are done."""
        if not pooled:
            return []
        h_PD = self.model_runner.pooled_PD
        if any(seq.pooling.normalize for seq in pooled):
            h_PD = torch.where(torch.tensor([[seq.pooling.normalize] for seq in pooled], device=h_PD.device),
                               torch.nn.functional.normalize(h_PD, dim=-1), h_PD)
        outputs = []
        for seq, vector in zip(pooled, h_PD.tolist()):
            seq.embedding = vector
            self.scheduler.finish(seq, "stop")
            outputs.append(self._output(self.requests.pop(seq.request_id)))
        return outputs

    def step_profile(self) -> dict[str, float]:
        """Cumulative seconds per phase of `step()`: schedule, prepare (inputs and attention indices),
        forward, sample, detokenize, postprocess (block hashing, end conditions, outputs; without
        detokenize)."""
        t, r = self.timings, self.model_runner.timings
        spec = {"propose": t["propose"]} if self.spec is not None else {}  # the drafting (ngram or draft model)
        return {**spec, "schedule": t["schedule"], "prepare": r["prepare"], "forward": r["forward"],
                "sample": t["sample"], "detokenize": t["detokenize"], "postprocess": t["postprocess"] - t["detokenize"]}

    def _idle(self) -> list[RequestOutput]:
        if self.requests:  # requests that can never fit are refused upfront, so this is a bug
            raise RuntimeError(f"scheduler made no progress with {len(self.requests)} requests: "
                               f"{list(self.scheduler.waiting)[:3]}")
        return []

    def _postprocess(self, seqs: list[Sequence], results: list[list[SampleResult]]) -> list[RequestOutput]:
        now, touched = time.time(), {}
        for seq, rs in zip(seqs, results):
            for r in rs:  # a verification's tokens one by one: any of them may end the sequence
                if self._append(seq, r, now):
                    break
            touched[seq.request_id] = self.requests[seq.request_id]
        outputs = []
        for req in touched.values():
            done = all(s.is_finished for s in req.seqs)
            if done:
                del self.requests[req.request_id]
            if done or req.output_kind != "final_only":
                outputs.append(self._output(req))
        return outputs

    def _append(self, seq: Sequence, r: SampleResult, now: float) -> bool:
        """Append one token and apply the end conditions; True when it finished the sequence."""
        seq.append_token(r.token_id, now)
        if seq.grammar is not None and not seq.grammar.accept(r.token_id):  # a bug: the mask allowed it
            log.error("request %s: grammar refused sampled token %d (%s; message %s)", seq.request_id, r.token_id,
                      seq.grammar.error.split(":", 1)[0], describe(seq.grammar.error))  # it quotes the output
        if r.logprob is not None:
            seq.cumulative_logprob += r.logprob
            seq.logprobs.append({r.token_id: r.logprob, **(r.top_logprobs or {})})
        delta, hit_stop = "", False
        if seq.detokenizer is not None:
            t0 = time.perf_counter()
            delta, hit_stop = seq.detokenizer.step([r.token_id])
            self.timings["detokenize"] += time.perf_counter() - t0
        seq.output_text += delta
        reason = self._finish_reason(seq, r.token_id, hit_stop)
        if reason is not None:
            if seq.detokenizer and not hit_stop:
                seq.output_text += seq.detokenizer.flush()
            self.scheduler.finish(seq, reason)
            if self.spec is not None:
                self.spec.release(seq)
        return reason is not None

    def _finish_reason(self, seq: Sequence, token_id: int, hit_stop: bool) -> str | None:
        p = seq.sampling_params
        if hit_stop:
            seq.stop_reason = seq.detokenizer.stop_str
            return "stop"
        if seq.grammar is not None and seq.grammar.is_terminated:  # complete: only EOS could follow
            return "abort" if seq.grammar.error else "stop"
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token_id in self.eos_token_ids:
                return "stop"
            if token_id in p.stop_token_ids:
                seq.stop_reason = token_id
                return "stop"
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, req: Request) -> RequestOutput:
        outs = []
        for i, s in enumerate(req.seqs):
            tok, chars = req.sent[i] if req.output_kind == "delta" else (0, 0)
            wants_lp = s.sampling_params.logprobs is not None
            outs.append(CompletionOutput(s.index, s.output_text[chars:], s.output_token_ids[tok:],
                                         s.cumulative_logprob if wants_lp else None,
                                         s.logprobs[tok:] if wants_lp else None, s.finish_reason, s.stop_reason,
                                         s.token_times[tok:]))
            if req.output_kind == "delta":
                req.sent[i] = (s.num_output_tokens, len(s.output_text))
        s0, seqs = req.seqs[0], req.seqs
        last = [s.token_times[-1] for s in seqs if s.token_times]
        firsts = [s.first_token_time for s in seqs if s.first_token_time is not None]
        done = all(s.is_finished for s in seqs)
        metrics = RequestMetrics(s0.arrival_time, s0.first_scheduled_time, min(firsts, default=None),
                                 max(last, default=None), max(s.finished_time for s in seqs) if done else None)
        prompt_lps = s0.prompt_logprobs
        if prompt_lps is not None and req.output_kind == "delta":  # the first output carries them, once
            prompt_lps, req.prompt_logprobs_sent = (None if req.prompt_logprobs_sent else prompt_lps), True
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, done, s0.num_cached_tokens,
                             metrics, prompt_lps, s0.embedding)

    # ---- statistics --------------------------------------------------------------------------------

    def _count(self, scheduled) -> None:
        c = self.counters
        c["steps"] += 1
        c["tokens_processed"] += sum(s.num_new_tokens for s in scheduled)
        c["kv_util_sum"] += self._kv_utilization()

    def _kv_utilization(self) -> float:
        """Tokens held in KV / token slots of allocated blocks; shared full blocks counted once."""
        bs, full, partial = self.config.block_size, set(), 0
        for seq in self.scheduler.running:
            n_full = seq.num_computed_tokens // bs
            full.update(seq.block_table[:n_full])
            partial += seq.num_computed_tokens - n_full * bs
        used = self.block_manager.num_used_blocks
        return (len(full) * bs + partial) / (used * bs) if used else 0.0

    def stats(self) -> dict:
        c, bm = self.counters, self.block_manager
        return dict(steps=c["steps"], preemptions=self.scheduler.num_preemptions,
                    prefix_cache_queries=bm.prefix_cache_queries, prefix_cache_hits=bm.prefix_cache_hits,
                    kv_blocks_total=bm.num_blocks, kv_blocks_in_use=bm.num_used_blocks,
                    kv_blocks_cached_free=sum(1 for b in bm.free if bm.blocks[b].hash is not None),
                    kv_utilization_avg=c["kv_util_sum"] / c["steps"] if c["steps"] else 0.0,
                    kv_util_sum=c["kv_util_sum"], tokens_processed=c["tokens_processed"],
                    running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                    num_requests_running=len({s.request_id for s in self.scheduler.running}),
                    **self.memory_stats(), **(self.spec.stats() if self.spec is not None else {}),
                    **(self.lora.stats() if self.lora is not None else {}),
                    num_requests_waiting=len({s.request_id for s in self.scheduler.waiting}
                                             - {s.request_id for s in self.scheduler.running}))

    def memory_stats(self) -> dict:
        """What the chosen schemes cost: weight bytes, KV bytes per token, pool capacity in tokens."""
        r, bs = self.model_runner, self.config.block_size
        return dict(weight_bytes=r.weight_bytes, weight_hugepage_bytes=r.hugepage_bytes,
                    linear_backend=r.linear_backend, attention_backend=r.attention_backend,
                    dtype=str(r.dtype).removeprefix("torch."), dtype_choice=self.dtype_choice,
                    quant_activations=self.config.quant_activations,
                    quant_activations_choice=self.quant_activations_choice,
                    kv_cache_dtype=self.config.kv_cache_dtype, kv_cache_dtype_choice=self.kv_choice,
                    kv_bytes_per_token=r.attn.bytes_per_block // bs,
                    kv_pool_tokens=self.block_manager.num_blocks * bs)

    # ---- what callers may read -------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def model_path(self) -> str:
        return str(self.config.model)
