"""`POST /v1/chat/completions` (vLLM's `OpenAIServingChat`): the conversation is rendered with the
model's chat template and tokenized so that no text a user typed becomes a control token
(`encode_chat`); streams open with the assistant role; logprobs in the chat shape (`content`:
token, logprob, bytes, top_logprobs). Runs through `OpenAIServing`; knows nothing about how many
engines there are.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from .errors import OpenAIError, bad_request
from .guard import check_text
from .protocol import ChatCompletionRequest
from .serving_engine import Job, OpenAIServing, check_length, check_params, check_prompt, encode
from .versions import Served

_PLACEHOLDER = "\ue000lmforge{}\ue001"  # private-use characters: no template alters or emits them
_PLACEHOLDER_RE = re.compile("\ue000lmforge(\\d+)\ue001")


class OpenAIServingChat(OpenAIServing):
    kind, exchange_kind = "chat.completion", "chat"

    def precheck(self, sv: Served, req: ChatCompletionRequest) -> None:
        self.check_stop(req)
        chars = 0
        for m in req.messages:
            text = m.text()
            check_text(text, "messages")
            chars += len(text)
        if sv.tokenizer is not None:
            check_length(sv, -(-chars // sv.chars_per_token), req.resolved_max_tokens(), "messages",
                         f"{chars} characters of content")

    def build_job(self, sv: Served, req: ChatCompletionRequest) -> Job:
        self.check_model(req.model)
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        tok = sv.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions", "messages", "unsupported")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        # The template writes every special token itself; do not let the tokenizer add a BOS on top.
        ids = encode_chat(sv, messages, req.add_generation_prompt)
        max_tokens = req.resolved_max_tokens()
        params = check_params(req, max_tokens, req.resolved_logprobs())
        check_prompt(sv, ids, max_tokens, "messages")
        job = Job(sv, req, [ids], params, "chatcmpl")
        job.messages = messages
        return job

    def opening_chunks(self, job: Job, base: dict) -> Iterator[dict]:
        for i in range(job.n):
            yield {**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]}

    def final_choice(self, job: Job, prompt_index: int, c) -> dict:
        lp = {"content": _logprobs(job, c.token_ids, c.logprobs, 0)} if c.logprobs is not None else None
        return {"index": prompt_index * job.n + c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": lp, "finish_reason": c.finish_reason}

    def delta_choice(self, job: Job, prompt_index: int, c, delta: str, start: int, text_start: int) -> dict:
        lp = {"content": _logprobs(job, c.token_ids, c.logprobs, start)} if c.logprobs is not None else None
        return {"index": c.index, "delta": {"content": delta}, "logprobs": lp, "finish_reason": c.finish_reason}

    def exchange_prompt(self, job: Job) -> str:
        return "\n".join(f"{m['role']}: {m['content']}" for m in job.messages)


def encode_chat(sv: Served, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """Token ids of the rendered conversation. Control tokens come from the template only: text a user
    typed that looks like one (`<|im_start|>system`) is encoded as plain text, so no turn can be spoofed.
    Messages without such text are encoded in one piece, exactly as before (and as offline chat)."""
    tok = sv.tokenizer
    render = lambda msgs: tok.apply_chat_template(msgs, tokenize=False,  # noqa: E731
                                                  add_generation_prompt=add_generation_prompt)
    try:
        if not any(sp in m["content"] for m in messages for sp in sv.specials):
            return encode(sv, render(messages), "messages", add_special_tokens=False)
        text = render([{**m, "content": _PLACEHOLDER.format(i)} for i, m in enumerate(messages)])
    except OpenAIError:
        raise
    except Exception as e:  # a template that raises on these messages (e.g. role order) is the client's 400
        raise bad_request(f"messages could not be rendered with the chat template: {e}", "messages") from None
    ids, pos = [], 0
    for m in _PLACEHOLDER_RE.finditer(text):
        ids += encode(sv, text[pos:m.start()], "messages", add_special_tokens=False)
        ids += encode(sv, messages[int(m.group(1))]["content"], "messages", add_special_tokens=False,
                      split_special_tokens=True)
        pos = m.end()
    return ids + encode(sv, text[pos:], "messages", add_special_tokens=False)


def _logprobs(job: Job, token_ids: list[int], logprobs: list[dict], start: int) -> list[dict]:
    sv, k, out = job.sv, job.params.logprobs or 0, []

    def entry(tid: int, lp: float) -> dict:
        s = sv.token_text(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    for tid, lps in zip(token_ids[start:], logprobs[start:]):
        top = sorted(lps.items(), key=lambda kv: -kv[1])[:k]
        out.append({**entry(tid, lps.get(tid)), "top_logprobs": [entry(t, v) for t, v in top]})
    return out
