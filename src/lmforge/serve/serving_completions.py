"""`POST /v1/completions` (vLLM's `OpenAIServingCompletion`): a prompt string, token ids, or a batch of
either; choices are numbered prompt * n + sample; `echo` prepends the prompt; legacy logprobs
(`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`). Runs through `OpenAIServing`; knows
nothing about how many engines there are.
"""

from __future__ import annotations

from collections.abc import Iterator

from .errors import bad_request
from .guard import check_text, min_tokens_for
from .protocol import CompletionRequest
from .serving_engine import Job, OpenAIServing, check_length, check_params, check_prompt, encode
from .versions import Served


class OpenAIServingCompletion(OpenAIServing):
    kind, exchange_kind = "text_completion", "completion"

    def precheck(self, sv: Served, req: CompletionRequest) -> None:
        self.check_stop(req)
        for p in req.prompts():
            if isinstance(p, str):
                check_text(p, "prompt")
                check_length(sv, min_tokens_for(p, sv.chars_per_token) if sv.tokenizer else 0, req.max_tokens,
                             "prompt", f"{len(p)} characters")

    def build_job(self, sv: Served, req: CompletionRequest) -> Job:
        self.check_model(req.model)
        prompts = req.prompts()
        if not prompts:
            raise bad_request("prompt is an empty list", "prompt")
        if req.echo and req.logprobs is not None:
            raise bad_request("echo with logprobs needs prompt logprobs, which this server does not return yet",
                              "echo", "unsupported")
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix", "unsupported")
        params = check_params(req, req.max_tokens, req.logprobs)
        ids = []
        for p in prompts:
            if isinstance(p, str):
                if sv.tokenizer is None:
                    raise bad_request("this model has no tokenizer: send prompts as token ids", "prompt")
                p = encode(sv, p, "prompt")  # the same call the engine makes, so outputs match offline LLM.generate
            check_prompt(sv, list(p), req.max_tokens, "prompt")
            ids.append(list(p))
        job = Job(sv, req, ids, params, "cmpl")
        job.texts = [p if isinstance(p, str) else None for p in prompts]
        return job

    def _prompt_text(self, job: Job, i: int) -> str:
        text = job.texts[i]
        return text if text is not None else job.sv.tokenizer.decode(job.prompts[i])

    def opening_chunks(self, job: Job, base: dict) -> Iterator[dict]:
        if not job.req.echo:
            return
        for p in range(len(job.prompts)):
            echo = self._prompt_text(job, p)
            for i in range(job.n):
                yield {**base, "choices": [{"index": p * job.n + i, "text": echo, "logprobs": None,
                                            "finish_reason": None}]}

    def final_choice(self, job: Job, prompt_index: int, c) -> dict:
        text = c.text
        if job.req.echo:
            text = self._prompt_text(job, prompt_index) + text
        lp = _logprobs(job, c.token_ids, c.logprobs, 0, 0) if c.logprobs is not None else None
        return {"index": prompt_index * job.n + c.index, "text": text, "logprobs": lp,
                "finish_reason": c.finish_reason}

    def delta_choice(self, job: Job, prompt_index: int, c, delta: str, start: int, text_start: int) -> dict:
        lp = _logprobs(job, c.token_ids, c.logprobs, start, text_start) if c.logprobs is not None else None
        return {"index": prompt_index * job.n + c.index, "text": delta, "logprobs": lp,
                "finish_reason": c.finish_reason}

    def exchange_prompt(self, job: Job) -> str:
        return "\n".join(t if t is not None else job.sv.tokenizer.decode(ids) if job.sv.tokenizer else str(ids)
                         for t, ids in zip(job.texts, job.prompts))


def _logprobs(job: Job, token_ids: list[int], logprobs: list[dict], start: int, offset: int) -> dict:
    """OpenAI's legacy shape for tokens[start:]; `offset` = characters of text before them."""
    sv, tokens, token_lps, tops, offsets = job.sv, [], [], [], []
    for tid, lps in zip(token_ids[start:], logprobs[start:]):
        s = sv.token_text(tid)
        tokens.append(s)
        token_lps.append(lps.get(tid))
        tops.append({sv.token_text(k): v for k, v in lps.items()})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
