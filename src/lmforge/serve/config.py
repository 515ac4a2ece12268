"""The server's typed configuration, validated once: what `build_app` needs besides the engine.

`ServerConfig` holds the app-level settings (the served name, the API key, the request limits
`ServerLimits`, the load-log interval, versions and feedback); `VersionsConfig` the champion's
label, a challenger and its canary share, the reloader and the rollback recorder; `ListenConfig`
what uvicorn needs (`lmforge serve` only). `lmforge serve` fills them from its
flags (`commands.py`); tests build them directly. This module knows nothing about HTTP routes, the
engine or the registry: a loader is any callable returning an engine, a feedback store any object
with the `FeedbackStore` methods.

    app = build_app(engine, ServerConfig("tiny", api_key="k", limits=ServerLimits(max_waiting=8)))
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .tool_parsers import TOOL_PARSERS

Loader = Callable[[], Any]  # () -> AsyncLLMEngine: builds an engine when called (the app then owns it)
# a LoRA adapter's served name: a model id a client sends, never a path part (no "/", "..", NUL, spaces)
LORA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


def check_lora_name(name: object) -> None:
    """ValueError naming `lora_name` for a name that cannot be an adapter's model id."""
    if not isinstance(name, str) or not LORA_NAME.fullmatch(name) or ".." in name:
        shown = repr(name[:40]) + ("..." if len(name) > 40 else "") if isinstance(name, str) else type(name).__name__
        raise ValueError(f"lora_name {shown}: an adapter's name is 1 to 64 of A-Z a-z 0-9 . _ : - starting with a "
                         "letter or digit, without '..' (it is a model id, never a path)")


@dataclass
class ServerLimits:
    """Limits checked before any work is done for a request (`guard.py` enforces them)."""

    max_body_bytes: int | None = None  # None: sized for the context, see body_limit()
    read_timeout_s: float = 30.0  # longest wait for the next piece of a request body
    body_timeout_s: float = 60.0  # the whole body, however it trickles in (408 after)
    header_timeout_s: float = 10.0  # request line + headers from the connection's first byte (408 after)
    keep_alive_timeout_s: float = 5.0  # an idle connection between requests is closed after this
    max_connections: int | None = 1024  # open connections; one more is answered 503 and closed
    linger_s: float = 5.0  # lingering close: how long a refused client may finish sending ...
    linger_bytes: int = 64 * 2**20  # ... and how much of it is read and dropped
    admin_requests_per_minute: int = 12  # per client address, on /admin/* (429 past it)
    max_waiting: int | None = None  # sequences admitted without a first token yet (None: unbounded)
    max_stop_strings: int = 16
    max_stop_len: int = 256  # characters per stop string
    max_engine_restarts: int = 3  # then the server exits non-zero, so a supervisor learns

    def body_limit(self, max_model_len: int) -> int:
        """A context's worth of prompt in the worst JSON encoding (a token id is <= 7 bytes with its
        comma; a character escaped as \\uXXXX is 6), times a batch of 16, plus 1 MiB for the rest."""
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return 2**20 + 16 * 8 * max_model_len

    def __post_init__(self) -> None:
        for name in ("read_timeout_s", "body_timeout_s", "header_timeout_s", "keep_alive_timeout_s", "linger_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ServerLimits.{name}={getattr(self, name)}: must be > 0 seconds")
        for name in ("max_connections", "admin_requests_per_minute", "linger_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"ServerLimits.{name}={value}: must be >= 1")


@dataclass
class VersionsConfig:
    """`version` labels the champion; `challenger=(label, loader)` serves a second version to
    `canary_percent` of requests (sticky per `user`), rolled back automatically when it does worse;
    `reloader()` returns `{role: (label, loader, path)}` for `POST /admin/reload`; `on_rollback(kind,
    details)` records rollbacks (the registry)."""

    version: str = "local"
    challenger: tuple[str, Loader] | None = None
    canary_percent: float = 0.0
    reloader: Callable[[], dict] | None = None
    on_rollback: Callable[[str, dict], None] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.canary_percent <= 100:
            raise ValueError(f"canary_percent={self.canary_percent}: a percent in [0, 100]")


@dataclass
class ServerConfig:
    """`feedback` (a FeedbackStore) enables `POST /v1/feedback`; with `log_requests` every exchange is
    stored there too (PII masked by the store)."""

    served_model_name: str
    api_key: str | None = None  # required as 'Authorization: Bearer KEY' on /v1/* when set
    limits: ServerLimits = field(default_factory=ServerLimits)
    log_interval_s: float = 5.0  # seconds between load log lines
    versions: VersionsConfig = field(default_factory=VersionsConfig)
    feedback: Any = None
    log_requests: bool = False
    admin_api_key: str | None = None  # required on /admin/*; without it the admin routes are off (403)
    tool_call_parser: str = "hermes"  # how the model writes tool calls (tool_parsers.py): hermes | llama3_json
    # multi-LoRA (serving_lora.py): adapter name -> peft folder, served over the base in one batch
    lora_modules: dict[str, str] = field(default_factory=dict)
    max_lora_rank: int = 16  # the engine's; adapters are checked against it when registered
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter, /v1/unload_lora_adapter (admin key)
    max_loaded_loras: int = 64  # adapters served at once, --lora-modules and runtime loads together (400 past it)
    # the text of a Jinja chat template (`lmforge serve --chat-template FILE`) used instead of the model's own
    # for chat requests that send no `chat_template` field of their own
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if self.log_interval_s <= 0:
            raise ValueError(f"log_interval_s={self.log_interval_s}: must be > 0")
        if self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser={self.tool_call_parser!r} (--tool-call-parser "
                             f"{self.tool_call_parser}: one of {', '.join(TOOL_PARSERS)})")
        for name in self.lora_modules:
            try:
                check_lora_name(name)
            except ValueError as e:
                raise ValueError(f"lora_modules (--lora-modules): {e}") from None
        if self.max_loaded_loras < 1 or len(self.lora_modules) > self.max_loaded_loras:
            raise ValueError(f"max_loaded_loras (--max-loaded-loras {self.max_loaded_loras}): must be >= 1 and hold "
                             f"the {len(self.lora_modules)} adapters of --lora-modules")
        if self.served_model_name in self.lora_modules:
            raise ValueError(f"lora_modules: {self.served_model_name!r} is the base model's name; name the adapter "
                             "otherwise")
        if self.chat_template is not None and not self.chat_template.strip():
            raise ValueError("chat_template is empty (--chat-template: a file holding a Jinja template)")
        for name, flag in (("api_key", "--api-key"), ("admin_api_key", "--admin-api-key")):
            key = getattr(self, name)
            if key is not None and not key.strip():  # an empty key would be matched by an empty `Bearer `
                raise ValueError(f"{name} is empty ({flag} ''): pass a key, or leave the flag out to turn it off")
        if self.admin_api_key is not None and self.admin_api_key == self.api_key:
            raise ValueError("admin_api_key must differ from api_key (--admin-api-key, --api-key): an inference "
                             "client must not administer")


@dataclass
class ListenConfig:
    """Where uvicorn listens, its log level, and the seconds in-flight requests get after SIGTERM/SIGINT
    (no defaults: only `lmforge serve` builds it, and its flags hold them)."""

    host: str
    port: int
    shutdown_timeout: float
    log_level: str
