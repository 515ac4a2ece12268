"""The chat template (ChatML) written into `tokenizer_config.json`.

Each message renders as `<|im_start|>{role}\\n{content}<|im_end|>\\n`; with
`add_generation_prompt=True` the prompt ends with `<|im_start|>assistant\\n` so the model
writes the reply and stops on `<|im_end|>`. An assistant message with a `reasoning_content`
field (the name Qwen3, DeepSeek-R1 and vLLM's reasoning parsers use) renders it first, as
`<think>\\n{reasoning}\\n</think>\\n{content}`: the reasoning format of
`lmforge.tasks.reasoning` (its default markers), so a trace stored as two fields and one stored
as rendered text become the same tokens. No `<|begin_of_text|>` is added: the template is the
single source of truth for chat text, and whoever packs documents decides on BOS.
`transformers`, vLLM and llama.cpp all render this Jinja template the same way. This module
knows nothing about training or models.
"""

from __future__ import annotations

from lmforge.tokenizer.special import IM_END, IM_START

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '" + IM_START + "' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' and message.get('reasoning_content') -%}"
    "{{- '" + THINK_OPEN + "\\n' + message['reasoning_content'] | trim + '\\n" + THINK_CLOSE + "\\n' -}}"
    "{%- endif -%}"
    "{{- message['content'] + '" + IM_END + "' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '" + IM_START + "assistant\\n' -}}"
    "{%- endif -%}"
)


def message_text(message: dict) -> str:
    """What the template puts between a message's header and its `<|im_end|>`."""
    reasoning = message.get("reasoning_content") if message.get("role") == "assistant" else None
    if reasoning:
        return f"{THINK_OPEN}\n{reasoning.strip()}\n{THINK_CLOSE}\n{message['content']}"
    return message["content"]


def render_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """Plain-Python reference of CHAT_TEMPLATE (tests check the Jinja version against it)."""
    text = "".join(f"{IM_START}{m['role']}\n{message_text(m)}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")
