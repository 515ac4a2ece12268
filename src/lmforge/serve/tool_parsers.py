"""Tool-call formats of chat-model families (vLLM's `--tool-call-parser`): how a model writes a call, how
it is read back into OpenAI's `tool_calls`, and the grammar that forces one.

* `hermes` (Hermes 2 Pro, Qwen2/2.5/3): `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`,
  one block per call; text before the first block is the message's content.
* `llama3_json` (Llama 3.1/3.2/3.3): the whole reply is `{"name": "f", "parameters": {...}}`, several calls
  separated by `; `, optionally after `<|python_tag|>`.

A parser reads the text the model wrote (`extract`, for a whole reply; `ToolCallStream`, for a stream,
fed the cumulative text each step), renders calls and tools for a template that does not know them
(`render_calls`, `system_prompt`, the prompts vLLM's and Hugging Face's Hermes-style templates write), and
builds the Lark grammar (llguidance's dialect, with `%json` schemas) that `tool_choice: "required"` or a
named function is enforced with. Arguments are passed on as the JSON text the model wrote, so a streamed
call's fragments join to the same string as the non-streamed one.

Knows nothing about HTTP, templates or the engine.

    python -m pytest -q tests/test_serve_tools.py
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

MAX_PARALLEL_CALLS = 8  # calls one forced reply may hold: bounded, so a weak model cannot loop until max_tokens
_SCALAR_END = re.compile(r"[,\]}\s]")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or new_call_id()

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"  # OpenAI's shape: call_ + 24 characters


# ---- a JSON scanner that reads partial text ----------------------------------------------------------------------

def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """text[i] == '"': the index after the closing quote, or None if the string is not closed yet."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """The index after the JSON value starting at text[i], or None if it is not complete yet."""
    if i >= len(text):
        return None
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] not in "{[":
        m = _SCALAR_END.search(text, i)  # a number or literal ends only where something follows it
        return m.start() if m else None
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c == '"':
            j = _string_end(text, j)
            if j is None:
                return None
            continue
        depth += 1 if c in "{[" else -1 if c in "}]" else 0
        j += 1
        if depth == 0:
            return j
    return None


def scan_object(text: str, start: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The JSON object at text[start] ('{'), read as far as the text goes: its top-level keys -> (value start,
    value end or None while incomplete), and the index after its closing brace (None while incomplete or
    malformed). A key's value span is exact text, so a partial `arguments` object can be streamed as is."""
    keys: dict[str, tuple[int, int | None]] = {}
    i = _skip_ws(text, start + 1)
    while i < len(text):
        if text[i] == "}":
            return keys, i + 1
        if text[i] != '"':
            return keys, None
        key_end = _string_end(text, i)
        if key_end is None:
            return keys, None
        colon = _skip_ws(text, key_end)
        if colon >= len(text) or text[colon] != ":":
            return keys, None
        vs = _skip_ws(text, colon + 1)
        if vs >= len(text):
            return keys, None
        ve = _value_end(text, vs)
        keys[json.loads(text[i:key_end])] = (vs, ve)
        if ve is None:
            return keys, None
        i = _skip_ws(text, ve)
        if i < len(text) and text[i] == ",":
            i = _skip_ws(text, i + 1)
    return keys, None


def _arguments_key(keys: dict) -> str | None:
    return next((k for k in ("arguments", "parameters") if k in keys), None)


def read_call(text: str, start: int) -> tuple[ToolCall | None, int | None]:
    """The complete call object at text[start] and the index after it; (None, end) when it is complete but not
    a call ({"name": str, "arguments"/"parameters": object}), (None, None) when incomplete."""
    keys, end = scan_object(text, start)
    if end is None:
        return None, None
    try:
        obj = json.loads(text[start:end])
    except json.JSONDecodeError:
        return None, end
    key = _arguments_key(keys)
    args = obj.get(key) if key else {}
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None, end
        raw = json.dumps(args, ensure_ascii=False)
    else:
        raw = text[keys[key][0]:keys[key][1]] if key else "{}"
    if not isinstance(obj.get("name"), str) or not isinstance(args, dict):
        return None, end
    return ToolCall(obj["name"], raw), end


# ---- the formats -------------------------------------------------------------------------------------------------

class ToolParser:
    """One family's format. `call_starts(text)` finds where each call object begins and where the content
    before the calls ends; `extract` and `ToolCallStream` share it."""

    name = ""
    arguments_key = "arguments"
    markers: tuple[str, ...] = ()  # text that frames calls; a tokenizer may hold them as special tokens
    call_instruction = ""  # how the system prompt tells the model to write a call

    def call_starts(self, text: str, final: bool) -> tuple[int, list[int]]:
        """(end of the content, start of each call object found so far). While not final, content that could
        still turn into a call marker is held back (its end is before it)."""
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole reply; text that is not a well-formed call is all content."""
        content_end, starts = self.call_starts(text, final=True)
        calls = []
        for s in starts:
            call, _ = read_call(text, s)
            if call is None:
                return text, []
            calls.append(call)
        if not calls:
            return text, []
        return text[:content_end] or None, calls

    def render_calls(self, calls: list[dict]) -> str:
        """Calls ({"name", "arguments": dict}) as this family writes them, for a template that cannot."""
        raise NotImplementedError

    def system_prompt(self, tools: list[dict]) -> str:
        """The tools for a template that ignores `tools` (the Hermes / Qwen2.5 system prompt's wording)."""
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                f"<tools>\n{listed}\n</tools>\n\n{self.call_instruction}")

    def grammar(self, tools: list[dict], parallel: bool, whitespace: str, specials: frozenset = frozenset()) -> str:
        """A Lark grammar (llguidance) whose language is one or more calls of `tools` in this format, the
        arguments validated by each function's `parameters` schema. A marker among `specials` (the
        tokenizer's special tokens) is matched as that token, not as text."""
        raise NotImplementedError

    def call_schema(self, tools: list[dict], whitespace: str) -> str:
        """The JSON schema of one call object: {"name": one of the tools, arguments: its parameters}."""
        branches = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                      self.arguments_key: _parameters(t)},
                     "required": ["name", self.arguments_key], "additionalProperties": False} for t in tools]
        schema = branches[0] if len(branches) == 1 else {"anyOf": branches}
        # JSON between tokens: bounded whitespace (as response_format), so every forced call can end
        return json.dumps({**schema, "x-guidance": {"whitespace_flexible": False, "whitespace_pattern": whitespace}})


def _parameters(tool: dict) -> dict:
    """A function's argument schema; none (or {}) is OpenAI's "no parameters": an empty object."""
    return tool["function"].get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}


def _lark_literal(s: str, specials: frozenset) -> str:
    return s if s in specials else json.dumps(s)  # <|name|>, unquoted, is llguidance's special-token syntax


class HermesToolParser(ToolParser):
    name = "hermes"
    open_tag, close_tag = "<tool_call>", "</tool_call>"
    markers = (open_tag, close_tag)
    call_instruction = ("For each function call, return a json object with function name and arguments within "
                        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def call_starts(self, text: str, final: bool) -> tuple[int, list[int]]:
        first = text.find(self.open_tag)
        if first < 0:
            return (len(text) if final else len(text) - _partial_suffix(text, self.open_tag)), []
        starts = []
        for m in re.finditer(re.escape(self.open_tag), text):
            s = _skip_ws(text, m.end())
            if s >= len(text) or text[s] != "{":
                break
            starts.append(s)
        return first, starts

    def render_calls(self, calls: list[dict]) -> str:
        return "\n".join(f"{self.open_tag}\n{json.dumps(c, ensure_ascii=False)}\n{self.close_tag}" for c in calls)

    def grammar(self, tools: list[dict], parallel: bool, whitespace: str, specials: frozenset = frozenset()) -> str:
        more = f' ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
        open_tag, close_tag = _lark_literal(self.open_tag, specials), _lark_literal(self.close_tag, specials)
        return (f"start: call{more}\n"
                f'call: {open_tag} "\\n" body "\\n" {close_tag}\n'
                f"body: %json {self.call_schema(tools, whitespace)}\n")


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    arguments_key = "parameters"
    python_tag = "<|python_tag|>"
    markers = (python_tag,)
    call_instruction = ("To call functions, respond only with JSON of the form "
                        '{"name": function name, "parameters": dictionary of argument name and its value}; '
                        "separate several calls with '; '. Do not use variables.")

    def call_starts(self, text: str, final: bool) -> tuple[int, list[int]]:
        i = _skip_ws(text, 0)
        if text.startswith(self.python_tag, i):
            i = _skip_ws(text, i + len(self.python_tag))
        elif not final and (i == len(text) or self.python_tag.startswith(text[i:])):
            return 0, []  # nothing but whitespace (or the start of the tag) yet: hold it back
        if i >= len(text) or text[i] != "{":
            return (len(text), []) if i < len(text) or final else (0, [])
        starts = [i]
        while True:
            _, end = scan_object(text, starts[-1])
            nxt = _skip_ws(text, end) if end is not None else len(text)
            if nxt >= len(text) or text[nxt] != ";":
                return 0, starts
            nxt = _skip_ws(text, nxt + 1)
            if nxt >= len(text) or text[nxt] != "{":
                return 0, starts
            starts.append(nxt)

    def render_calls(self, calls: list[dict]) -> str:
        return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False)
                         for c in calls)

    def grammar(self, tools: list[dict], parallel: bool, whitespace: str, specials: frozenset = frozenset()) -> str:
        more = f' ("; " body){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
        return f"start: body{more}\nbody: %json {self.call_schema(tools, whitespace)}\n"


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker` (it may become the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser={name!r}: one of {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


# ---- streaming ---------------------------------------------------------------------------------------------------

class ToolCallStream:
    """One streamed sample: fed its cumulative text each step, it answers what to send now, OpenAI's way:
    content as it comes (a possible call marker held back), then per call a first `delta.tool_calls` entry with
    index, id, type and `function.name` (once the name is complete), then `function.arguments` fragments,
    exactly the argument text the model wrote."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None):
        self.parser, self.max_calls = parser, max_calls  # calls past max_calls (None: no limit) are not sent
        self.sent_content = 0
        self.calls: list[dict] = []  # per call sent: {"id", "sent": characters of arguments sent}

    def update(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        content_end, starts = self.parser.call_starts(text, final)
        if final and not self.calls and not any(read_call(text, s)[0] for s in starts):
            content_end = len(text)  # nothing became a call: all of it is content, as `extract` says
        content = text[self.sent_content:content_end] if content_end > self.sent_content else ""
        self.sent_content = max(self.sent_content, content_end)
        deltas = []
        for index, start in enumerate(starts[:self.max_calls]):
            delta = self._call_delta(text, index, start)
            if delta is None:
                break  # a call's header goes out before any later call's
            if delta:
                deltas.append(delta)
        return content, deltas

    def _call_delta(self, text: str, index: int, start: int) -> dict | None:
        keys, _ = scan_object(text, start)
        if index == len(self.calls):
            name = _complete_string(text, keys.get("name"))
            if name is None:
                return None
            self.calls.append({"id": new_call_id(), "sent": 0})
            delta = {"index": index, "id": self.calls[index]["id"], "type": "function",
                     "function": {"name": name, "arguments": ""}}
        else:
            delta = {"index": index, "function": {}}
        fragment = self._arguments_fragment(text, keys, start, self.calls[index])
        if fragment:
            delta["function"]["arguments"] = delta["function"].get("arguments", "") + fragment
        return delta if "id" in delta or fragment else {}

    @staticmethod
    def _arguments_fragment(text: str, keys: dict, start: int, call: dict) -> str:
        key = _arguments_key(keys)
        if key is None:
            return ""
        vs, ve = keys[key]
        if text[vs] == "{":  # an object: stream its text as it grows
            piece = text[vs:ve if ve is not None else len(text)]
        elif ve is not None and call["sent"] == 0:  # a string holding JSON: only once whole
            parsed, _ = read_call(text, start)
            piece = parsed.arguments if parsed else ""
        else:
            piece = ""
        out = piece[call["sent"]:]
        call["sent"] += len(out)
        return out


def _complete_string(text: str, span: tuple[int, int | None] | None) -> str | None:
    if span is None or span[1] is None or text[span[0]] != '"':
        return None
    return json.loads(text[span[0]:span[1]])
