"""The chat template (ChatML) written into `tokenizer_config.json`.

Each message renders as `<|im_start|>{role}\\n{content}<|im_end|>\\n`; with
`add_generation_prompt=True` the prompt ends with `<|im_start|>assistant\\n` so the model
writes the reply and stops on `<|im_end|>`. No `<|begin_of_text|>` is added: the template
is the single source of truth for chat text, and whoever packs documents decides on BOS.
`transformers`, vLLM and llama.cpp all render this Jinja template the same way. This module
knows nothing about training or models.
"""

from __future__ import annotations

from lmforge.tokenizer.special import IM_END, IM_START

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '" + IM_START + "' + message['role'] + '\\n' + message['content'] + '" + IM_END + "' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '" + IM_START + "assistant\\n' -}}"
    "{%- endif -%}"
)


def render_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """Plain-Python reference of CHAT_TEMPLATE (tests check the Jinja version against it)."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")
