"""`LLM`: vLLM's offline API over `LLMEngine`.

    from lmforge.engine import LLM, SamplingParams
    llm = LLM("path/to/hf-dir", dtype="bfloat16")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text, llm.stats())
    outs = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=32))  # the model's template

Submits every prompt at once and steps the engine until all finish, so the scheduler batches
them; outputs come back in input order. Knows nothing about scheduling or tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .config import EngineConfig
from .llm_engine import LLMEngine
from .lora import LoRARequest
from .outputs import RequestOutput
from .sampling_params import SamplingParams


def _final_only(params: Sequence[SamplingParams]) -> list[SamplingParams]:
    """Offline callers only see finished outputs: ask for those alone (vLLM does the same), so the
    engine builds no per-step output copies."""
    converted: dict[int, SamplingParams] = {}
    for p in params:
        if id(p) not in converted:
            converted[id(p)] = p if p.output_kind != "cumulative" else dataclasses.replace(p, output_kind="final_only")
    return [converted[id(p)] for p in params]


class LLM:
    def __init__(self, model: str, **engine_options):
        """`model`: a model folder or a .gguf file; `engine_options`: any `EngineConfig` field (dtype, device,
        block_size, max_num_seqs, quant_activations, speculative_method, enable_lora, ...), as vLLM's
        `LLM(model, **kwargs)` takes its engine arguments. An unknown option is a TypeError naming it."""
        self.llm_engine = LLMEngine(EngineConfig(model=str(model), **engine_options))
        self._counter = 0

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def stats(self) -> dict:
        return self.llm_engine.stats()

    def load_weights(self, state_dict: dict) -> None:
        """Copy a trainer's weights (a `Transformer.state_dict()`, same names) into the engine's model in
        place, and forget the prefix cache (its K/V came from the old weights). For RL rollouts that must
        follow the policy every step (vLLM's `load_weights` / TRL's weight sync, in-process). Works with
        the compiled CPU kernels (the fused modules hold the model's own tensors); needs weights that were
        not repacked or quantized: `pack_weights=False` (or a float16 / CUDA engine). Call it between `generate`
        calls."""
        engine = self.llm_engine
        runner = engine.model_runner
        if engine.has_unfinished_requests():
            raise RuntimeError("load_weights while requests are running; call it between generate() calls")
        if engine.executor is not None:  # the workers hold shards: they would need the new weights too
            raise ValueError(f"load_weights is not supported with tensor_parallel_size="
                             f"{engine.config.tensor_parallel_size}; use tensor_parallel_size=1")
        if runner.packed_linears or runner.quantized_linears or not runner.named_weights:
            raise ValueError("load_weights needs the checkpoint's own weights: create the LLM with "
                             "pack_weights=False and an unquantized model")
        dst = runner.named_weights
        missing, unexpected = sorted(set(dst) - set(state_dict)), sorted(set(state_dict) - set(dst))
        if missing or unexpected:
            raise ValueError(f"load_weights: state dict does not match the engine's model "
                             f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
        with torch.no_grad():
            for name, t in dst.items():
                src = state_dict[name]
                if src.shape != t.shape:
                    raise ValueError(f"load_weights: {name} has shape {tuple(src.shape)}, the engine's "
                                     f"{tuple(t.shape)}")
                t.copy_(src)  # into the existing storage, which the fused modules share
        engine.block_manager.forget_cached()

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Outputs in input order; `lora_request`: one adapter for every prompt, or one (or None) per prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt, as text or as token ids
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params; pass one or one per prompt")
        params = _final_only(params)
        loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} lora requests; pass one or one per prompt")
        engine, ids = self.llm_engine, []
        try:
            for prompt, p, lora in zip(prompts, params, loras):  # all validated before any runs
                ids.append(str(self._counter))
                self._counter += 1
                engine.add_request(ids[-1], prompt, p, lora_request=lora)
        except Exception:
            for rid in ids:
                engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of `{"role", "content"}` messages) or a list of them,
        each rendered with the model's chat template (or `chat_template`, a Jinja string) by the tokenizer's
        `apply_chat_template`, as transformers renders it, tokenized without adding special tokens (the
        template writes them), then generated as `generate` does. Outputs in input order."""
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError(f"{self.llm_engine.config.model}: no tokenizer, so no chat template; pass token ids "
                             "to generate()")
        if not messages:
            raise ValueError("chat() needs at least one message")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [tok.encode(self._render(tok, conv, chat_template, add_generation_prompt, continue_final_message,
                                           tools, chat_template_kwargs or {}), add_special_tokens=False)
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    @staticmethod
    def _render(tok, conversation: Sequence[dict], chat_template: str | None, add_generation_prompt: bool,
                continue_final_message: bool, tools: list[dict] | None, kwargs: dict) -> str:
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message are exclusive (vLLM's rule): "
                             "continue the last assistant message or open a new one")
        if chat_template is None and not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; pass chat_template=")
        return tok.apply_chat_template(list(conversation), tokenize=False, chat_template=chat_template,
                                       add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message, tools=tools, **kwargs)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm  # deferred: only for a progress bar (tqdm.auto probes for a notebook)

            bar = tqdm(total=len(ids), desc="generate", unit="req", dynamic_ncols=True)
        try:
            while self.llm_engine.has_unfinished_requests():
                for out in self.llm_engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [finished[rid] for rid in ids]
