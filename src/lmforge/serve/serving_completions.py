"""`POST /v1/completions` (vLLM's `OpenAIServingCompletion`): a prompt string, token ids, or a batch of
either; choices are numbered prompt * n + sample; `echo` prepends the prompt; legacy logprobs
(`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`), over the echoed prompt too (its first token's
`null`: nothing predicts it), from the engine's prompt logprobs; `max_tokens: 0` with `echo` returns the
prompt alone (lm-eval's loglikelihood requests); vLLM's `prompt_logprobs` per choice. Runs through
`OpenAIServing`; knows nothing about how many engines there are.
"""

from __future__ import annotations

from collections.abc import Iterator

from .errors import bad_request
from .guard import check_text, min_tokens_for
from .protocol import CompletionRequest
from .serving_engine import (Job, OpenAIServing, check_length, check_params, check_prompt, encode,
                             prompt_logprobs_json, truncate)
from .versions import Served


class OpenAIServingCompletion(OpenAIServing):
    kind, exchange_kind = "text_completion", "completion"

    def precheck(self, sv: Served, req: CompletionRequest) -> None:
        self.check_stop(req)
        for p in req.prompts():
            if isinstance(p, str):
                check_text(p, "prompt")
                if req.truncate_prompt_tokens is None:  # a truncated prompt's length is known after tokenizing
                    check_length(sv, min_tokens_for(p, sv.chars_per_token) if sv.tokenizer else 0, req.max_tokens,
                                 "prompt", f"{len(p)} characters")

    def build_job(self, sv: Served, req: CompletionRequest) -> Job:
        self.check_model(req.model)
        prompts = req.prompts()
        if not prompts:
            raise bad_request("prompt is an empty list", "prompt")
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix", "unsupported")
        if req.max_tokens == 0 and not req.echo:
            raise bad_request("max_tokens=0 asks for nothing: it is allowed with echo only (the prompt and its "
                              "logprobs)", "max_tokens")
        max_tokens = 1 if req.max_tokens == 0 else req.max_tokens  # echo alone: one token, generated and dropped
        # echo + logprobs: the prompt's tokens get logprobs too (prompt logprobs, computed in the prefill)
        params = check_params(req, max_tokens, req.logprobs, req.logprobs if req.echo else None, sv=sv)
        ids, texts = [], []
        for p in prompts:
            full = p
            if isinstance(p, str):
                if sv.tokenizer is None:
                    raise bad_request("this model has no tokenizer: send prompts as token ids", "prompt")
                full = encode(sv, p, "prompt")  # the same call the engine makes, so outputs match offline LLM.generate
            tokens = truncate(sv, list(full), req.truncate_prompt_tokens)
            check_prompt(sv, tokens, max_tokens, "prompt")
            ids.append(tokens)
            texts.append(p if isinstance(p, str) and len(tokens) == len(full) else None)  # truncated: decoded
        if req.echo and sv.tokenizer is not None:  # decoded once here, on the tokenize worker
            texts = [t if t is not None else sv.tokenizer.decode(i) for t, i in zip(texts, ids)]
        job = Job(sv, req, ids, params, "cmpl")
        job.texts = texts
        job.echo_only = req.max_tokens == 0
        return job

    def _prompt_text(self, job: Job, i: int) -> str:
        text = job.texts[i]
        return text if text is not None else job.sv.tokenizer.decode(job.prompts[i]) if job.sv.tokenizer else ""

    def final_choice(self, job: Job, prompt_index: int, c) -> dict:
        return self._choice(job, prompt_index, c, c.text, 0, 0)

    def delta_choice(self, job: Job, prompt_index: int, c, delta: str, start: int, text_start: int) -> dict:
        return self._choice(job, prompt_index, c, delta, start, text_start)

    def _choice(self, job: Job, p: int, c, text: str, start: int, text_start: int) -> dict:
        """One choice from token `start` (character `text_start`) of sample `c` on; the piece that starts at 0
        carries the echoed prompt, its logprobs and vLLM's `prompt_logprobs` first."""
        ids, lps = c.token_ids[start:], c.logprobs[start:] if c.logprobs is not None else None
        if job.echo_only:  # max_tokens=0: the token generated to run the prefill is not part of the answer
            text, ids, lps = "", [], [] if lps is not None else None
        first, echo, lp = start == 0, "", None
        if first and job.req.echo:
            echo = self._prompt_text(job, p)
        if lps is not None:
            lp = _logprobs(job, ids, lps, text_start + (len(self._prompt_text(job, p)) if job.req.echo else 0))
            if first and job.req.echo:
                lp = _join(_echo_logprobs(job, job.prompts[p], job.prompt_logprobs[p]), lp)
        choice = {"index": p * job.n + c.index, "text": echo + text, "logprobs": lp, "finish_reason": c.finish_reason}
        if job.req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(job.sv, job.prompt_logprobs[p]) if first else None
        return choice

    def exchange_prompt(self, job: Job) -> str:
        return "\n".join(t if t is not None else job.sv.tokenizer.decode(ids) if job.sv.tokenizer else str(ids)
                         for t, ids in zip(job.texts, job.prompts))


def _logprobs(job: Job, token_ids: list[int], logprobs: list[dict], offset: int) -> dict:
    """OpenAI's legacy shape for generated tokens; `offset` = characters of text before them."""
    sv, tokens, token_lps, tops, offsets = job.sv, [], [], [], []
    for tid, lps in zip(token_ids, logprobs):
        s = sv.token_text(tid)
        tokens.append(s)
        token_lps.append(lps.get(tid))
        tops.append({sv.token_text(k): v for k, v in lps.items()})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _echo_logprobs(job: Job, prompt_ids: list[int], prompt_lps: list | None) -> dict:
    """The echoed prompt's tokens in the legacy shape: `null` logprob and top_logprobs for the first token
    (nothing predicts it), as OpenAI's and vLLM's echo give, which lm-eval's loglikelihood reads."""
    sv, tokens, token_lps, tops, offsets, offset = job.sv, [], [], [], [], 0
    for tid, entry in zip(prompt_ids, prompt_lps or [None] * len(prompt_ids)):
        s = sv.token_text(tid)
        tokens.append(s)
        token_lps.append(entry[tid].logprob if entry else None)
        tops.append({sv.token_text(k): v.logprob for k, v in entry.items()} if entry else None)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _join(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}
