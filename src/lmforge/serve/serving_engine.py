"""What the completion and chat endpoints share (vLLM's `OpenAIServing`): a validated request becomes
a `Job`, runs on the one version the `EngineClient` routed it to, and is answered as one JSON body
or as SSE chunks.

A subclass (`serving_completions.py`, `serving_chat.py`) says how its request is checked and
tokenized (`precheck` on the event loop, `build_job` on the tokenize worker) and how an output is
rendered (`final_choice`, `delta_choice`, `opening_chunks`, `exchange_prompt`). Everything else is
here, once:

* admission: a job's sequences are reserved (`guard.Admission`) before it runs and released as first
  tokens arrive, so `--max-waiting` counts what really waits;
* a client that goes away cancels the job, which aborts its engine requests (`_unless_disconnected`
  for JSON; Starlette cancels a stream's body iterator);
* metrics from each output's engine timestamps, outside the step loop; the request's outcome for the
  canary guard and its exchange for the request log (`_ended`), committed before the answer's last
  byte goes out (`_durable`: the JSON body, a stream's `[DONE]`);
* engine errors mapped to the client's 400, a 500 without internals, or a 503 (`engine_error`).

Knows nothing about how many engines there are, scheduling, sampling or KV paging.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from lmforge.engine import EngineDeadError, EngineStepError, RequestOutput, SamplingParams
from lmforge.engine.sampling_params import truncate_prompt
from lmforge.engine.structured import check_spec
from lmforge.tools.redact import redacted_traceback

from .engine_client import EngineRequest, not_ready
from .errors import OpenAIError, bad_request, from_value_error
from .guard import Ticket, check_text
from .versions import Served

log = logging.getLogger("lmforge.serve")
VERSION_HEADER = "x-lmforge-model-version"


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


class Job:
    """One HTTP request: its engine prompts (token ids), sampling params, and what rendering needs."""

    ticket: Ticket  # its sequences' share of the admission count
    lora_request = None  # the LoRA adapter its `model` picked (set once, after build_job), or the base

    def __init__(self, sv: Served, req, prompts: list[list[int]], params: SamplingParams, prefix: str):
        self.sv, self.req, self.prompts, self.params = sv, req, prompts, params
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.n = params.n
        self.texts: list[str | None] = [None] * len(prompts)  # completions: the prompt strings given
        self.messages: list[dict] = []  # chat: the conversation
        self.prompt_logprobs: list[list | None] = [None] * len(prompts)  # per prompt, from its first output
        self.echo_only = False  # completions' max_tokens=0 with echo: the one token generated is dropped
        self.logged = False  # its exchange went to the request log (`_ended`), to be committed before the answer


class Tracker:
    """Per engine request: what was already sent (text, tokens) and the timing bookkeeping."""

    __slots__ = ("sent_text", "sent_tokens", "done", "last", "last_token_time", "started")

    def __init__(self, n: int):
        self.sent_text, self.sent_tokens, self.done = [0] * n, [0] * n, [False] * n
        self.last: RequestOutput | None = None
        self.last_token_time: float | None = None
        self.started = 0  # samples with a first token (or finished): no longer waiting


def engine_error(e: Exception) -> OpenAIError:
    """ValueErrors are the engine's admission checks (the client's 400); a failed step or a dead engine
    say so without internals; anything else is a bug: logged with its traceback, 500 to the client."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, ValueError):
        return from_value_error(e)
    if isinstance(e, EngineStepError):
        return OpenAIError(500, str(e), None, "engine_error")
    if isinstance(e, EngineDeadError):
        return OpenAIError(503, f"the engine stopped while serving this request: {e}", None, "engine_not_ready")
    log.error("request failed:\n%s", redacted_traceback(e))  # messages may quote the request: never logged
    return OpenAIError(500, "internal error; the server log has the details", None, "internal_error")


class OpenAIServing:
    kind: str  # the response's `object`: "text_completion" | "chat.completion"
    exchange_kind: str  # the request log's `kind`: "completion" | "chat"

    def __init__(self, st):
        self.st = st  # app.ServerState: client, metrics, admission, limits, exchange log, tokenize pool

    async def __call__(self, req, raw: Request):
        refused = req.unsupported()
        if refused is not None:
            raise bad_request(f"{refused[0]}: {refused[1]}", refused[0], "unsupported_parameter")
        sv = self.st.client.route(req.user)
        self.precheck(sv, req)
        job = await asyncio.get_running_loop().run_in_executor(self.st.tokenize_pool, self.build_job, sv, req)
        job.lora_request = self.st.loras.lookup(req.model)  # on the loop: 404 if unloaded meanwhile
        return await self.serve(raw, job)

    # ---- the subclass's part ----------------------------------------------------------------------------------

    def precheck(self, sv: Served, req) -> None:
        """On the event loop, before any work: valid text, and no prompt too long to tokenize."""
        raise NotImplementedError

    def build_job(self, sv: Served, req) -> Job:
        """On the tokenize worker: checks, tokenization, sampling params."""
        raise NotImplementedError

    def opening_chunks(self, job: Job, base: dict) -> Iterator[dict]:
        return iter(())

    def final_choice(self, job: Job, prompt_index: int, c) -> dict:
        raise NotImplementedError

    def delta_choice(self, job: Job, prompt_index: int, c, delta: str, start: int, text_start: int) -> dict:
        raise NotImplementedError

    def exchange_prompt(self, job: Job) -> str | list[dict]:
        """What the exchange log stores as the prompt: the text, or a chat's messages."""
        raise NotImplementedError

    def response_extras(self, job: Job) -> dict:
        """Top-level fields of a non-streamed response besides OpenAI's (chat: vLLM's `prompt_logprobs`)."""
        return {}

    # ---- checks both endpoints make ------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        """The base's name, a served LoRA adapter's (`serving_lora.LoRAAdapters`), or none; else 404."""
        self.st.loras.lookup(model)

    def check_stop(self, req) -> None:
        lim = self.st.limits
        stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        if len(stops) > lim.max_stop_strings:
            raise bad_request(f"stop: at most {lim.max_stop_strings} stop strings, got {len(stops)}", "stop")
        for s in stops:
            check_text(s, "stop")
            if len(s) > lim.max_stop_len:
                raise bad_request(f"stop: each stop string has at most {lim.max_stop_len} characters, got one of "
                                  f"{len(s)}", "stop")

    # ---- running a job -------------------------------------------------------------------------------------------

    async def serve(self, raw: Request, job: Job):
        if not job.sv.ready:  # the engine may have died while the request was tokenized
            raise OpenAIError(503, not_ready(job.sv), None, "engine_not_ready")
        job.ticket = self.st.admission.reserve(len(job.prompts) * job.n)  # no await since the check: atomic
        headers = {VERSION_HEADER: job.sv.label}
        if job.req.stream:
            body = self.stream(job)
            weakref.finalize(body, job.ticket.release)  # a stream that never started still gives its share back
            return StreamingResponse(body, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        try:
            return JSONResponse(await _unless_disconnected(raw, self.complete(job)), headers=headers)
        finally:
            job.ticket.release()

    async def outputs(self, job: Job, trackers: list[Tracker]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, cumulative output) from every engine request of the job, as they come.

        Leaving early (a disconnect cancels us, or an error) aborts every engine request still running:
        the client's `generate` aborts when its consumer goes away, and pumps are cancelled."""
        st = self.st
        gens = [st.client.generate(job.sv, EngineRequest(f"{job.id}-{i}", ids, job.params, job.lora_request))
                for i, ids in enumerate(job.prompts)]
        try:
            if len(gens) == 1:
                async for out in gens[0]:
                    self._on_output(job, 0, trackers[0], out)
                    yield 0, out
                return
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i: int, gen) -> None:
                try:
                    async for out in gen:
                        queue.put_nowait((i, out))
                except Exception as e:
                    queue.put_nowait((i, e))
                    return
                queue.put_nowait((i, None))

            tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
            try:
                ended = 0
                while ended < len(tasks):
                    i, item = await queue.get()
                    if item is None:
                        ended += 1
                    elif isinstance(item, Exception):
                        raise item
                    else:
                        self._on_output(job, i, trackers[i], item)
                        yield i, item
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            job.ticket.release()
            for t in trackers:
                if t.last is not None and not t.last.finished:  # aborted: count it, as vLLM does
                    st.metrics.observe_finished(job.sv.label, t.last, "abort")

    def _on_output(self, job: Job, p: int, t: Tracker, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:
            job.prompt_logprobs[p] = out.prompt_logprobs
        started = sum(1 for c in out.outputs if c.token_ids or c.finish_reason is not None)
        if started > t.started:
            job.ticket.release(started - t.started)
            t.started = started
        ltt = out.metrics.last_token_time
        if t.last_token_time is not None and ltt is not None and ltt > t.last_token_time:
            self.st.metrics.observe_itl(job.sv.label, ltt - t.last_token_time)
        t.last_token_time = ltt
        t.last = out
        if out.finished:
            self.st.metrics.observe_finished(job.sv.label, out)

    async def drain(self, job: Job, trackers: list[Tracker]) -> None:
        """Run the job to its end into `trackers`; an engine failure is recorded and raised as its HTTP error."""
        try:
            async for _ in self.outputs(job, trackers):
                pass
        except Exception as e:
            err = engine_error(e)
            self._ended(job, trackers, err.status)
            raise err from None

    async def complete(self, job: Job) -> dict:
        trackers = [Tracker(job.n) for _ in job.prompts]
        await self.drain(job, trackers)
        choices = [self.final_choice(job, i, c) for i, t in enumerate(trackers) for c in t.last.outputs]
        self._ended(job, trackers, 200)
        await self._durable(job)
        return {"id": job.id, "object": self.kind, "created": job.created, "model": _model_name(self.st, job),
                "system_fingerprint": _fingerprint(job), "choices": choices, "usage": _usage(trackers, job),
                **self.response_extras(job)}

    async def stream(self, job: Job) -> AsyncIterator[str]:
        """SSE chunks; one per sample per engine step. A cancelled stream (client gone) aborts."""
        trackers = [Tracker(job.n) for _ in job.prompts]
        base = {"id": job.id, "object": self.kind + ".chunk", "created": job.created,
                "model": _model_name(self.st, job), "system_fingerprint": _fingerprint(job)}
        status = 200
        try:
            for chunk in self.opening_chunks(job, base):
                yield sse(chunk)
            async for p, out in self.outputs(job, trackers):
                t = trackers[p]
                for c in out.outputs:
                    if t.done[c.index] or (len(c.token_ids) == t.sent_tokens[c.index] and c.finish_reason is None):
                        continue
                    yield sse({**base, "choices": [self._delta(job, t, p, c)]})
            if job.req.include_usage:
                yield sse({**base, "choices": [], "usage": _usage(trackers, job)})
        except Exception as e:  # headers are gone: report in-band, as vLLM does
            err = engine_error(e)
            status = err.status
            self.st.metrics.count_error(err.status)
            yield sse(err.body())
        self._ended(job, trackers, status)
        await self._durable(job)
        yield "data: [DONE]\n\n"

    async def _durable(self, job: Job) -> None:
        """Wait (bounded) until the exchange `_ended` logged is committed: an answer a client saw end is in
        the store, whatever is killed next (the cost: one writer round trip, shared by concurrent answers)."""
        if job.logged and self.st.exchange_log is not None:
            await self.st.exchange_log.committed(job.id)

    def _delta(self, job: Job, t: Tracker, p: int, c) -> dict:
        i, start, text_start = c.index, t.sent_tokens[c.index], t.sent_text[c.index]
        delta = c.text[text_start:]
        t.sent_text[i], t.sent_tokens[i] = len(c.text), len(c.token_ids)
        t.done[i] = c.finish_reason is not None
        return self.delta_choice(job, p, c, delta, start, text_start)

    def _ended(self, job: Job, trackers: list[Tracker], status: int) -> None:
        """A request is over: its outcome feeds the canary guard, its exchange the request log."""
        st = self.st
        st.client.outcome(job.sv.label, status >= 500)
        if status == 200:
            st.metrics.observe_repetition(job.sv.label, [c.text for t in trackers if t.last is not None
                                                         for c in t.last.outputs])
        if st.exchange_log is None or status != 200:
            return
        response = "\n".join(c.text for t in trackers if t.last is not None for c in t.last.outputs)
        job.logged = st.exchange_log.add({"id": job.id, "created": job.created, "model": st.served_model_name,
                             "model_version": job.sv.label, "user": job.req.user, "kind": self.exchange_kind,
                             "prompt": self.exchange_prompt(job), "response": response})


async def _unless_disconnected(raw: Request, coro):
    """Run `coro`; cancel it (which aborts its engine requests) if the client disconnects first."""
    work = asyncio.ensure_future(coro)

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
            raise OpenAIError(499, "client disconnected", None, "client_disconnected")
    return work.result()


def _usage(trackers: list[Tracker], job: Job) -> dict:
    outs = [t.last for t in trackers if t.last is not None]
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = 0 if job.echo_only else sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _model_name(st, job: Job) -> str:
    """The `model` a response names: the adapter the request ran on, else the base."""
    return job.lora_request.lora_name if job.lora_request is not None else st.served_model_name


def _fingerprint(job: Job) -> str:
    return f"lmforge-{job.sv.label}"


def check_prompt(sv: Served, ids: list[int], max_tokens: int | None, param: str) -> None:
    if not ids:
        raise bad_request("the prompt is empty: at least one token is needed", param)
    bad = [t for t in ids if not 0 <= t < sv.vocab_size]
    if bad:
        raise bad_request(f"prompt token ids must be in [0, {sv.vocab_size}): got {bad[:5]}", param)
    need = len(ids) + (max_tokens or 1)
    if need > sv.max_model_len:
        raise bad_request(f"this model's maximum context length is {sv.max_model_len} tokens; the request has "
                          f"{len(ids)} prompt tokens and asks for {max_tokens or 1} more ({need})",
                          "max_tokens" if max_tokens else param, "context_length_exceeded")


def check_params(req, max_tokens: int | None, logprobs: int | None,
                 prompt_logprobs: int | None = None, sv: Served | None = None) -> SamplingParams:
    """The request's SamplingParams, its structured-output spec checked to compile and, with the version's
    tokenizer, to run its first tokens (on the tokenize worker: a spec that fails in the engine would
    surface in-band, after a stream's 200, or as finish_reason "abort")."""
    if req.stream and req.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs is not available with stream: true (as in vLLM); send the request "
                          "without stream", "prompt_logprobs")
    try:
        params = req.sampling_params(max_tokens, logprobs, prompt_logprobs)
        if params.structured_outputs is not None:
            check_spec(params.structured_outputs, *((sv.tokenizer, sv.vocab_size) if sv is not None else ()))
        return params
    except ValueError as e:
        err = from_value_error(e)
        if err.param == "structured_outputs":
            err.param = req.structured_field() or err.param
        raise err from None


def truncate(sv: Served, ids: list[int], truncate_prompt_tokens: int | None) -> list[int]:
    """vLLM's `truncate_prompt_tokens`, by the engine's own rule (it applies it again, to the same result)."""
    try:
        return truncate_prompt(ids, truncate_prompt_tokens, sv.max_model_len)
    except ValueError as e:
        raise from_value_error(e) from None


def prompt_logprobs_json(sv: Served, prompt_logprobs: list | None) -> list | None:
    """vLLM's `prompt_logprobs` JSON: per prompt token null (the first) or {token id: {logprob, rank,
    decoded_token}}."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                                                 "decoded_token": sv.token_text(t)} for t, lp in entry.items()}
            for entry in prompt_logprobs]


def check_length(sv: Served, at_least: int, max_tokens: int | None, param: str, what: str) -> None:
    need = at_least + (max_tokens or 1)
    if need > sv.max_model_len:
        raise bad_request(f"this model's maximum context length is {sv.max_model_len} tokens; the {param} has "
                          f"{what}, so at least {at_least} tokens, and asks for {max_tokens or 1} more",
                          "max_tokens" if max_tokens else param, "context_length_exceeded")


def encode(sv: Served, text: str, param: str, **kw) -> list[int]:
    try:
        return sv.tokenizer.encode(text, **kw)
    except Exception as e:  # check_text ran, so this is text this tokenizer cannot represent
        raise bad_request(f"the tokenizer could not encode the {param} ({type(e).__name__})", param,
                          "invalid_text") from None
