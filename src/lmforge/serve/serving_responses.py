"""`POST /v1/responses`, OpenAI's Responses API for text in and text out (vLLM serves the same subset):
`input` (a string or a list of messages with text content), `instructions` (a system message first),
`max_output_tokens`, `temperature`, `top_p`, `user`, and `stream: true` with the Responses event types
(`response.created`, `response.in_progress`, `response.output_item.added`, `response.content_part.added`,
`response.output_text.delta` ..., `response.output_text.done`, `response.content_part.done`,
`response.output_item.done`, `response.completed`). The conversation is rendered and run exactly as
`/v1/chat/completions` runs it (this class is `OpenAIServingChat` with another output shape). Not served,
each a 400 naming the field: tools, structured `text.format`, non-text content (images, files), items other
than messages, `previous_response_id` / `conversation` / `background` (responses are not stored).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from pydantic import ValidationError

from .errors import bad_request
from .protocol import ResponsesRequest
from .serving_chat import OpenAIServingChat
from .serving_engine import Job, Tracker, dumps, engine_error


class OpenAIServingResponses(OpenAIServingChat):
    async def __call__(self, req: ResponsesRequest, raw):
        refused = req.unsupported()
        if refused is not None:
            raise bad_request(f"{refused[0]}: {refused[1]}", refused[0], "unsupported_parameter")
        try:
            chat = req.chat_request()
        except ValidationError as e:  # e.g. an empty `input` list: no message to answer
            raise bad_request(f"input: not a conversation ({e.errors()[0]['msg']})", "input") from None
        return await super().__call__(chat, raw)

    async def complete(self, job: Job) -> dict:
        trackers = [Tracker(job.n)]
        await self.drain(job, trackers)
        self._ended(job, trackers, 200)
        await self._durable(job)
        return self._response(job, trackers, "completed")

    async def stream(self, job: Job) -> AsyncIterator[str]:
        trackers, seq = [Tracker(job.n)], iter(range(1 << 62))
        item_id = f"msg_{uuid.uuid4().hex}"

        def event(kind: str, **fields) -> str:
            return f"event: {kind}\ndata: {dumps({'type': kind, 'sequence_number': next(seq), **fields})}\n\n"

        where = {"item_id": item_id, "output_index": 0, "content_index": 0}
        status, text = 200, ""
        yield event("response.created", response=self._response(job, trackers, "in_progress"))
        yield event("response.in_progress", response=self._response(job, trackers, "in_progress"))
        yield event("response.output_item.added", output_index=0, item=_message(item_id, "", "in_progress", False))
        yield event("response.content_part.added", **where, part=_text_part(""))
        try:
            async for _, out in self.outputs(job, trackers):
                delta, text = out.outputs[0].text[len(text):], out.outputs[0].text
                if delta:
                    yield event("response.output_text.delta", **where, delta=delta, logprobs=[])
        except Exception as e:  # headers are gone: report in-band, as a `response.failed`
            err = engine_error(e)
            status = err.status
            self.st.metrics.count_error(err.status)
            yield event("error", code=err.code, message=err.message, param=err.param)
            yield event("response.failed", response=self._response(job, trackers, "failed"))
        self._ended(job, trackers, status)
        if status == 200:
            await self._durable(job)  # before the events that end the answer
            final = self._response(job, trackers, "completed", item_id)
            yield event("response.output_text.done", **where, text=text, logprobs=[])
            yield event("response.content_part.done", **where, part=_text_part(text))
            yield event("response.output_item.done", output_index=0, item=final["output"][0])
            yield event("response.completed", response=final)

    def _response(self, job: Job, trackers: list[Tracker], status: str, item_id: str | None = None) -> dict:
        """The Response object; once finished, `incomplete` (with the reason) when max_output_tokens cut it."""
        out = trackers[0].last
        c = out.outputs[0] if out is not None else None
        if status == "completed" and c is not None and c.finish_reason == "length":
            status = "incomplete"
        usage = None
        if out is not None and out.finished:
            n_in, n_out = len(out.prompt_token_ids), len(c.token_ids)
            usage = {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                     "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": n_in + n_out}
        output = [] if status in ("in_progress", "failed") or c is None else \
            [_message(item_id or f"msg_{uuid.uuid4().hex}", c.text, "completed" if status == "completed" else
                      "incomplete", True)]
        p = job.params
        return {"id": "resp_" + job.id.split("-", 1)[1], "object": "response", "created_at": job.created,
                "status": status, "model": self.st.served_model_name, "output": output,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "error": None, "instructions": None, "max_output_tokens": job.req.max_tokens,
                "temperature": p.temperature, "top_p": p.top_p, "parallel_tool_calls": False, "tool_choice": "none",
                "tools": [], "text": {"format": {"type": "text"}}, "truncation": "disabled", "store": False,
                "metadata": {}, "usage": usage, "user": job.req.user}


def _message(item_id: str, text: str, status: str, with_text: bool) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [_text_part(text)] if with_text else []}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
