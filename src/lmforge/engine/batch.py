"""`lmforge generate`: batch inference over a JSONL file of prompts, in one process or on Ray.

Input, one request per line: `prompt` (text, or a list of token ids) or `messages` (chat, rendered
with the model's chat template and encoded without added special tokens, as the server does),
an optional `custom_id` (or `id`; default: the line number; two lines with one id are refused) and
optional sampling fields, any of
`SamplingParams`'s (`temperature`, `top_p`, `top_k`, `max_tokens`, `seed`, `stop`, `n`, ...),
which override the run's defaults for that line; `meta` is ignored. Output, one line per input
line in input order: an OpenAI completion record (`text_completion` or `chat.completion`, with
`choices`, `usage` and the `custom_id`; no `created`, so two runs can be compared byte for byte),
each choice also carrying its `token_ids`.

Every line is checked before any work, and every bad one is named with its line number: its JSON and
fields when the file is read, then its prompt through the engine's own admission (empty, a token id past
the vocabulary, longer than the context leaves; `check_requests`, on the first replica with Ray). A line
without a `seed` (and no run default) samples with one derived from its `custom_id`
(`derived_seed`), so its record does not depend on which batch or replica drew it.

Resumable: records are appended a batch at a time (flushed and fsynced); a rerun keeps the
records already written (each must carry the `custom_id` of its input line, or the run stops),
drops a torn last line, and generates the rest. `executor="ray"` with `replicas=N` starts N Ray
actors, each holding one engine (`LLM`), hands batches to them in turn and writes the results
in input order: greedy outputs are those of the single-process run, and sampled ones too (every
request is seeded, by its line or from its custom_id); a resumed run writes what one run writes. Ray's `ray.data.llm` batch processor is the interface anchor.
This module knows nothing about HTTP; Ray is imported only when asked for.

    from lmforge.engine.batch import generate_file
    generate_file("runs/model", "prompts.jsonl", "out.jsonl", defaults={"max_tokens": 64})
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmforge.tools.cluster import connect_ray

from .llm import LLM
from .outputs import RequestOutput
from .sampling_params import SamplingParams

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) - {"output_kind"}
RAY_MISSING = "--executor ray needs Ray, which is not installed: pip install 'lmforge[ray]'"
MAX_LISTED = 50  # bad lines named one by one in the error; the rest are counted


@dataclass
class BatchRequest:
    custom_id: str
    prompt: str | list[int] | None  # None: `messages` instead
    messages: list[dict] | None
    params: dict[str, Any]  # SamplingParams fields of this line, over the run's defaults
    where: str = ""  # "FILE:LINE", for errors that name the line


def _parse_line(path: Path, lineno: int, line: str, defaults: dict[str, Any]) -> BatchRequest:
    where = f"{path}:{lineno}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: malformed JSON ({e.msg}); fix or remove the line") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object with 'prompt' or 'messages'")
    unknown = set(row) - SAMPLING_FIELDS - {"prompt", "messages", "custom_id", "id", "meta"}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}; a line holds prompt or "
                         f"messages, custom_id, meta and sampling fields ({', '.join(sorted(SAMPLING_FIELDS))})")
    prompt, messages = row.get("prompt"), row.get("messages")
    if (prompt is None) == (messages is None):
        raise ValueError(f"{where}: give exactly one of 'prompt' (text or token ids) and 'messages'")
    if messages is not None and not (isinstance(messages, list) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        raise ValueError(f"{where}: 'messages' must be a list of {{role, content}} objects with string values")
    if prompt is not None and not (isinstance(prompt, str) or (isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt))):
        raise ValueError(f"{where}: 'prompt' must be a string or a list of token ids")
    if prompt is not None and not prompt or messages == []:
        raise ValueError(f"{where}: the prompt is empty; at least one token is needed")
    custom_id = str(row.get("custom_id", row.get("id", lineno)))
    params = {**defaults, **{k: v for k, v in row.items() if k in SAMPLING_FIELDS}}
    if params.get("seed") is None:
        params["seed"] = derived_seed(custom_id)
    try:
        SamplingParams(**params)  # every line checked before any work
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
    return BatchRequest(custom_id, prompt, messages, params, where)


def derived_seed(custom_id: str) -> int:
    """The seed of a line that names none: from its custom_id alone (56 bits of sha256), so the same line
    samples the same tokens in any batch, on any replica, in a resumed run."""
    return int.from_bytes(hashlib.sha256(f"lmforge-generate:{custom_id}".encode()).digest()[:7], "big")


def read_requests(path: str | os.PathLike, defaults: dict[str, Any] | None = None) -> list[BatchRequest]:
    """Every request of the file, validated: one ValueError naming every bad line (file, line, field) and every
    custom_id that repeats an earlier line's."""
    requests, errors = _read(Path(path), dict(defaults or {}))
    raise_bad_lines(path, errors)
    return requests


def _read(path: Path, defaults: dict[str, Any]) -> tuple[list[BatchRequest], list[tuple[int, str]]]:
    """The file's good requests, and (line, why) for each bad line."""
    unknown = set(defaults) - SAMPLING_FIELDS
    if unknown:
        raise ValueError(f"unknown sampling default(s) {', '.join(sorted(unknown))}")
    requests, errors, first_line = [], [], {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                req = _parse_line(path, n, line, defaults)
            except ValueError as e:
                errors.append((n, str(e)))
                continue
            if req.custom_id in first_line:
                errors.append((n, f"{path}:{n}: custom_id {req.custom_id!r} is also line {first_line[req.custom_id]}'s; "
                                  "give each line an id of its own (records are matched to lines by it)"))
            first_line.setdefault(req.custom_id, n)
            requests.append(req)
    return requests, errors


def raise_bad_lines(path: str | os.PathLike, errors: list[tuple[int, str]]) -> None:
    """One ValueError listing the bad lines in line order (the first MAX_LISTED, then a count), or nothing."""
    if not errors:
        return
    listed = [why for _, why in sorted(errors)[:MAX_LISTED]]
    more = f"\n... and {len(errors) - MAX_LISTED} more" if len(errors) > MAX_LISTED else ""
    raise ValueError(f"{len(errors)} line(s) of {path} cannot be generated; nothing was generated:\n"
                     + "\n".join(listed) + more)


def check_requests(llm: LLM, requests: list[BatchRequest]) -> list[tuple[int, str]]:
    """Each request through the engine's own admission (its prompt tokenized and checked against the
    vocabulary, the context and the KV pool) and withdrawn at once: (line, "FILE:LINE: why") for each refused."""
    engine, errors = llm.llm_engine, []
    for i, req in enumerate(requests):
        rid = f"lmforge-generate-check-{i}"
        try:
            engine.add_request(rid, _encode(llm, req), SamplingParams(**req.params))
        except Exception as e:  # a chat template's own errors too: each is this line's problem
            line = int(req.where.rsplit(":", 1)[1]) if req.where else 0
            errors.append((line, f"{req.where}: {(str(e).strip().splitlines() or [type(e).__name__])[0]}"))
            continue
        engine.abort_request(rid)
    return errors


def _encode(llm: LLM, req: BatchRequest) -> str | list[int]:
    if req.messages is None:
        return req.prompt
    tok = llm.get_tokenizer()
    if tok is None:
        raise ValueError(f"request {req.custom_id}: 'messages' needs the model's tokenizer and chat template")
    text = tok.apply_chat_template(req.messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def _record(req: BatchRequest, out: RequestOutput, model: str) -> dict[str, Any]:
    """An OpenAI completion / chat.completion object for one request (plus each choice's token ids)."""
    chat = req.messages is not None
    choices = []
    for c in out.outputs:
        body = {"message": {"role": "assistant", "content": c.text}} if chat else {"text": c.text}
        choices.append({"index": c.index, **body, "token_ids": c.token_ids, "finish_reason": c.finish_reason})
    completion = sum(len(c.token_ids) for c in out.outputs)
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{req.custom_id}", "custom_id": req.custom_id,
            "object": "chat.completion" if chat else "text_completion", "model": model, "choices": choices,
            "usage": {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": completion,
                      "total_tokens": len(out.prompt_token_ids) + completion}}


def run_batch(llm: LLM, requests: list[BatchRequest], model: str) -> list[dict[str, Any]]:
    """Records of a batch of requests, in order, from one engine (all submitted at once)."""
    prompts = [_encode(llm, r) for r in requests]
    outs = llm.generate(prompts, [SamplingParams(**r.params) for r in requests], use_tqdm=False)
    return [_record(r, o, model) for r, o in zip(requests, outs)]


class Replica:
    """One engine in a Ray actor (its torch threads bounded, so replicas share a node's cores)."""

    def __init__(self, model: str, engine_kwargs: dict[str, Any], threads: int):
        torch.set_num_threads(threads)
        self.llm = LLM(model, **engine_kwargs)

    def run(self, requests: list[BatchRequest], name: str) -> list[dict[str, Any]]:
        return run_batch(self.llm, requests, name)

    def check(self, requests: list[BatchRequest]) -> list[tuple[int, str]]:
        return check_requests(self.llm, requests)


def _resume(out: Path, requests: list[BatchRequest], overwrite: bool) -> int:
    """How many records `out` already holds for these requests (a torn last line is cut off)."""
    if overwrite or not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(b"")
        return 0
    data = out.read_bytes()
    keep = data[:data.rfind(b"\n") + 1]  # up to the last complete line
    lines = keep.decode("utf-8").splitlines()
    if len(lines) > len(requests):
        raise ValueError(f"{out}: {len(lines)} records for {len(requests)} requests; pass --overwrite")
    for n, (line, req) in enumerate(zip(lines, requests), start=1):
        try:
            got = json.loads(line).get("custom_id")
        except (json.JSONDecodeError, AttributeError):
            got = None
        if got != req.custom_id:
            raise ValueError(f"{out}:{n}: record for custom_id {got!r}, but input line {n} is {req.custom_id!r}: "
                             "the file was written for other input; pass --overwrite or choose another --out")
    if len(keep) != len(data):
        with open(out, "r+b") as f:
            f.truncate(len(keep))
    return len(lines)


def _batches(requests: list[BatchRequest], size: int) -> Iterator[list[BatchRequest]]:
    for i in range(0, len(requests), size):
        yield requests[i:i + size]


def _ray_results(model: str, name: str, batches: list[list[BatchRequest]], replicas: int,
                 engine_kwargs: dict[str, Any], address: str | None,
                 input_path: Path | None = None, bad: list[tuple[int, str]] = ()) -> Iterator[list[dict[str, Any]]]:
    """Batches on `replicas` actors in turn (batch k on actor k mod N), results in batch order,
    at most two batches per actor in flight; every request checked on the first actor before any runs."""
    try:
        import ray  # deferred: optional dependency (pip install 'lmforge[ray]')
    except ImportError:
        raise ImportError(RAY_MISSING) from None
    connect_ray(address)  # a HOST:PORT with nothing there: ClusterUnreachable naming it, within 30 s
    cpus = int(ray.cluster_resources().get("CPU", 1))
    threads = max(1, cpus // replicas)
    actor = ray.remote(num_cpus=min(threads, cpus), max_restarts=2, max_task_retries=2)(Replica)
    actors = [actor.remote(model, engine_kwargs, threads) for _ in range(replicas)]
    try:
        if batches:
            raise_bad_lines(input_path, [*bad, *ray.get(actors[0].check.remote([r for b in batches for r in b]))])
        pending: list[Any] = []
        for k, batch in enumerate(batches):
            pending.append(actors[k % replicas].run.remote(batch, name))
            if len(pending) >= 2 * replicas:
                yield ray.get(pending.pop(0))
        while pending:
            yield ray.get(pending.pop(0))
    finally:
        for a in actors:
            ray.kill(a)


def generate_file(model: str | os.PathLike, input_path: str | os.PathLike, out_path: str | os.PathLike, *,
                  defaults: dict[str, Any] | None = None, executor: str = "local", replicas: int = 1,
                  ray_address: str | None = None, batch_size: int = 64, overwrite: bool = False,
                  model_name: str | None = None, engine_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Generate a record per input line into `out_path` (resuming it); returns a summary."""
    if executor not in ("local", "ray"):
        raise ValueError(f"executor {executor!r}: choose 'local' or 'ray'")
    if replicas < 1 or (replicas > 1 and executor != "ray"):
        raise ValueError(f"--replicas {replicas}: replicas need --executor ray (and are at least 1)")
    if batch_size < 1:
        raise ValueError(f"--batch-size {batch_size}: must be at least 1")
    requests, bad = _read(Path(input_path), dict(defaults or {}))  # bad lines: named with the engine's below
    out, model, name = Path(out_path), os.fspath(model), model_name or Path(model).name
    if bad and not requests:
        raise_bad_lines(input_path, bad)
    done = 0 if bad else _resume(out, requests, overwrite)  # with bad lines --out is left as it is
    t0, engine_kwargs = time.monotonic(), dict(engine_kwargs or {})
    batches = list(_batches(requests[done:], batch_size))
    if executor == "ray":
        results = _ray_results(model, name, batches, replicas, engine_kwargs, ray_address, Path(input_path), bad)
    else:
        llm = LLM(model, **engine_kwargs) if batches else None
        raise_bad_lines(input_path, [*bad, *(check_requests(llm, requests[done:]) if llm is not None else ())])
        results = (run_batch(llm, b, name) for b in batches)
    usage = {"prompt_tokens": 0, "completion_tokens": 0}
    with open(out, "a", encoding="utf-8") as f:
        for records in results:
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
            f.flush()
            os.fsync(f.fileno())
            for r in records:
                usage["prompt_tokens"] += r["usage"]["prompt_tokens"]
                usage["completion_tokens"] += r["usage"]["completion_tokens"]
    seconds = time.monotonic() - t0
    return {"requests": len(requests), "resumed": done, "generated": len(requests) - done, **usage,
            "seconds": round(seconds, 3), "executor": executor, "replicas": replicas,
            "completion_tokens_per_s": round(usage["completion_tokens"] / max(seconds, 1e-9), 2)}
