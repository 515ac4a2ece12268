"""Multi-LoRA serving, the HTTP side: which model names are adapters, and vLLM's runtime endpoints.

`LoRAAdapters` maps each served adapter name to its `LoRARequest` (name, a fresh int id per load, the
peft folder): a request's `model` picks an adapter, the base's own name picks none, anything else is
a 404 (`OpenAIServing.check_model`). Adapters come from `--lora-modules name=path ...` at start, and,
only with `--allow-runtime-lora-updating` (vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING`), from
`POST /v1/load_lora_adapter` / `POST /v1/unload_lora_adapter` (`ServingLoRA`), which change what is
served and so need the admin key (`guard.py` checks it on those two paths as on `/admin/*`).

A folder is checked when it is registered (its config, and every tensor against the base's shapes:
`lmforge.engine.lora.read_adapter`), so a bad adapter is refused at load, not at its first request.
Unloading removes the name at once; requests already running on it finish; the engine's slot is
reused by LRU. Knows nothing about the engine's slots or batching.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from pathlib import Path

from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from lmforge.engine import LoRARequest
from lmforge.engine.lora import check_adapter, read_adapter_config

from .config import check_lora_name
from .errors import OpenAIError, bad_request


_ERROR = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/OpenAIError"}}}}
# what /openapi.json says the two endpoints answer: vLLM's plain-text success, and the admin guard's refusals
ROUTE_RESPONSES = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
                   401: {"description": "missing or invalid admin key", **_ERROR},
                   403: {"description": "admin endpoints are off (no --admin-api-key)", **_ERROR},
                   429: {"description": "too many admin requests from this address", **_ERROR}}


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


class LoRAAdapters:
    """Served adapter names -> `LoRARequest`s, over the base named `base_name` with `max_lora_rank` slots; at
    most `max_loaded` of them (`--max-loaded-loras`, as vLLM's `--max-cpu-loras` bounds what it keeps)."""

    def __init__(self, base_name: str, max_lora_rank: int = 16, max_loaded: int = 64):
        self.base_name, self.max_lora_rank, self.max_loaded = base_name, max_lora_rank, max_loaded
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def __contains__(self, name: str | None) -> bool:
        return name in self.by_name

    def names(self) -> list[str]:
        return list(self.by_name)

    def add(self, name: str, path: str, model_dir: str | Path | None) -> LoRARequest:
        """Check the folder (against the base at `model_dir`; its config alone without one: the engine
        checks the tensors at the first request) and serve it as `name`; ValueError says why not. The name
        and the cap are checked before the folder is read and again, under a lock, before it is served."""
        self.check_name(name)
        if model_dir is None:
            read_adapter_config(path, self.max_lora_rank)
        else:
            check_adapter(path, model_dir, self.max_lora_rank, name)
        with self._lock:  # two loads at once: one of them gets the name (or the last place)
            self.check_name(name)
            self.by_name[name] = LoRARequest(name, next(self._ids), str(path))
            return self.by_name[name]

    def check_name(self, name: str) -> None:
        """ValueError naming `lora_name`: not a model id, the base's, already served, or no place left."""
        check_lora_name(name)
        if name == self.base_name:
            raise ValueError(f"lora_name {name!r}: an adapter needs a name of its own, not the base model's")
        if name in self.by_name:
            raise ValueError(f"the LoRA adapter {name!r} has already been loaded; unload it first")
        if len(self.by_name) >= self.max_loaded:
            raise ValueError(f"lora_name {name!r}: {len(self.by_name)} adapters are loaded, the most this server "
                             f"serves at once (--max-loaded-loras {self.max_loaded}); unload one first")

    def remove(self, name: str) -> LoRARequest | None:
        return self.by_name.pop(name, None)

    def lookup(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` picks (None: the base); 404 for a name not served (any more)."""
        if model is None or model == self.base_name:
            return None
        if model not in self.by_name:  # the list of names is GET /v1/models', not every 404's
            shown = repr(model[:64]) + ("..." if len(model) > 64 else "")
            raise OpenAIError(404, f"the model {shown} does not exist; GET /v1/models lists the models served here",
                              "model", "model_not_found")
        return self.by_name[model]

    def cards(self, created: int, max_model_len: int) -> list[dict]:
        """/v1/models entries: `parent` is the base; `root` the adapter's name (never a path on this machine)."""
        return [{"id": n, "object": "model", "created": created, "owned_by": "lmforge", "root": n,
                 "parent": self.base_name, "max_model_len": max_model_len} for n in self.by_name]


class ServingLoRA:
    """`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's bodies and answers)."""

    def __init__(self, st):
        self.st = st  # app.ServerState: loras, client

    async def load(self, req: LoadLoRAAdapterRequest) -> PlainTextResponse:
        st = self.st
        if not st.client.ready:
            raise OpenAIError(503, st.client.not_ready_reason(), None, "engine_not_ready")
        try:  # the name first: a bad name or a full table reads no folder
            st.loras.check_name(req.lora_name)
        except ValueError as e:
            raise bad_request(str(e), "lora_name") from None
        if "\x00" in req.lora_path:
            raise bad_request("lora_path holds a NUL character", "lora_path")
        try:  # reads the folder: off the event loop
            await asyncio.to_thread(st.loras.add, req.lora_name, req.lora_path, st.router.champion.model_dir)
        except ValueError as e:
            raise bad_request(str(e), "lora_name" if str(e).startswith(("lora_name", "the LoRA adapter")) else
                              "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload(self, req: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        gone = self.st.loras.remove(req.lora_name)
        if gone is None:
            raise OpenAIError(404, f"the LoRA adapter {req.lora_name!r} cannot be found", "lora_name", "not_found")
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
