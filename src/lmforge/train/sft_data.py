"""Supervised fine-tuning batches from a chat JSONL file, with loss on assistant tokens only.

Input: one conversation per line, `{"messages": [{"role": ..., "content": ...}, ...]}` (an
assistant message may carry `reasoning_content`, rendered as the chat template does), or one task
row per line (`prompt`/`answer`/`reasoning`, GSM8K's `question`/`answer` with `#### N`), which
becomes a user turn and an assistant turn in the reasoning format. Each
message is tokenized piece by piece in the shape of the ChatML template
(`<|im_start|>{role}\\n` + content + `<|im_end|>` + `\\n`), so we know exactly which ids are the
assistant's: its content tokens and its closing `<|im_end|>` carry loss; the header, the `\\n`
after `<|im_end|>`, and every system/user/tool token do not. Encoding the header and the content
separately is deliberate: at inference the prompt ends with `<|im_start|>assistant\\n` and the
model then emits the content's tokens, which is exactly the split trained on here. (For
ordinary text the ids equal `apply_chat_template(tokenize=True)`; they differ only when content
starts with whitespace that BPE would merge into the header's `\\n`.) No `<|begin_of_text|>` is
added, because the chat template adds none and the server renders prompts with the template.
A conversation without a system turn gets the one the tokenizer's own template would add
(`default_system_message`: SmolLM2's and Qwen2.5's templates open every chat with a default system
prompt), so SFT trains on the tokens that eval, GRPO and the server render for the same chat.

Output: the pretraining loader's contract. Batches are dicts of LongTensors `input_ids`,
`labels` (already shifted: `labels[t]` is the target for `input_ids[t]`; -100 = no loss),
`doc_ids` and `position_ids`, all (B, T) with T = seq_len. A conversation of n tokens yields
n-1 (input, label) positions, so one of up to seq_len+1 tokens fills a row; longer ones are cut
to seq_len+1 tokens (counted in `.stats`, and warned about). With `packed=True` conversations
are laid next to each other in rows (next-fit, in file order, never split) and `doc_ids` /
`position_ids` keep them from attending to each other; the unfilled tail of a row is pad tokens
in a document of their own. With `packed=False` each conversation gets its own row.

Rows are fixed at construction and then served exactly as `lmforge.data.loader.PackedLoader`
serves pretraining rows: epoch e visits them in `np.random.default_rng(seed + e).permutation`,
step s takes the global slice `order[s*B*W:(s+1)*B*W]` and rank r keeps `[r::W]` of it (so rank
r takes every W-th row of the shuffled order and W ranks see what one process with batch W*B
sees); an incomplete last global batch of an epoch is skipped. The loader is an endless
iterator; `state_dict()` / `load_state_dict()` resume at the exact next batch, also under a
different world size with the same global batch.

This module knows nothing about models, optimizers or the training loop.

    from lmforge.train.sft_data import SFTLoader
    loader = SFTLoader("chat.jsonl", tokenizer, seq_len=2048, batch_size=8)
    batch = next(loader)  # {"input_ids", "labels", "doc_ids", "position_ids"}: (B, T) int64

Shape legend: B batch rows, T tokens per row (= seq_len).
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from lmforge.data.synth import TaskFileError, parse_task
from lmforge.tasks.reasoning import DEFAULT_FORMAT
from lmforge.tokenizer.chat import message_text
from lmforge.tokenizer.special import IM_END, IM_START, PAD
from lmforge.track.io import sha256_file

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index
LOSS_ROLE = "assistant"


class SFTDataError(ValueError):
    """A line of a chat JSONL file is not a valid conversation; the message names file, line, field."""


@dataclass
class SFTStats:
    """Counts that reconcile: lines = conversations + without_assistant (+ blank lines skipped)."""

    conversations: int = 0  # kept: at least one loss token after truncation
    without_assistant: int = 0  # dropped: no assistant token left to learn from
    truncated: int = 0  # cut to seq_len + 1 tokens
    rows: int = 0
    tokens: int = 0  # input positions holding conversation tokens (not padding)
    assistant_tokens: int = 0  # positions with a label (!= -100)
    padding_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class _Conversation:
    ids: torch.Tensor  # (n,) int32 token ids
    loss_mask: torch.Tensor  # (n,) bool: True where the token is one the model must learn to emit


def pad_id(tokenizer: Any) -> int:
    """lmforge's `<|pad|>`, else the tokenizer's pad or EOS token (a Hugging Face model's tokenizer, e.g. Qwen2.5's,
    has no `<|pad|>`): padding never carries loss and sits in a document of its own, so any id serves."""
    pad = tokenizer.convert_tokens_to_ids(PAD)
    if pad is not None and pad != tokenizer.unk_token_id:
        return pad
    for pad in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if pad is not None:
            return pad
    raise SFTDataError(f"the tokenizer has neither {PAD}, a pad token nor an EOS token to pad rows with")


def _fail(path: str, lineno: int, field: str, why: str) -> SFTDataError:
    return SFTDataError(f"{path}:{lineno}: field {field!r}: {why}")


def parse_messages(line: str, path: str, lineno: int) -> list[dict[str, str]]:
    """The validated `messages` list of one JSONL line; raises SFTDataError naming what is wrong."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise SFTDataError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno}); "
                           'each line must be {"messages": [{"role": ..., "content": ...}, ...]}') from e
    if isinstance(record, dict) and "messages" not in record and ("prompt" in record or "question" in record):
        return task_messages(record, f"{path}:{lineno}")
    if not isinstance(record, dict) or "messages" not in record:
        raise _fail(path, lineno, "messages", "missing; each line must be an object with a "
                    '"messages" list (or a task row with prompt/answer)')
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise _fail(path, lineno, "messages", f"must be a non-empty list, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _fail(path, lineno, f"messages[{i}]", f"must be an object, got {type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise _fail(path, lineno, f"messages[{i}].{key}", "missing")
            if not isinstance(m[key], str):
                raise _fail(path, lineno, f"messages[{i}].{key}",
                            f"must be a string, got {type(m[key]).__name__}")
        if not m["role"]:
            raise _fail(path, lineno, f"messages[{i}].role", "is empty")
        if not isinstance(m.get("reasoning_content", ""), str):
            raise _fail(path, lineno, f"messages[{i}].reasoning_content", "must be a string")
        for marker in (IM_START, IM_END):
            # Inside content it would be encoded as the control token itself and end the
            # message early (an assistant trained on it would learn to stop mid-reply).
            if marker in m["content"] or marker in m["role"]:
                raise _fail(path, lineno, f"messages[{i}]", f"contains the control token {marker}; "
                            "remove or escape it")
    return messages


def task_messages(record: dict, where: str) -> list[dict[str, str]]:
    """A task row (prompt/answer with or without reasoning, or GSM8K's question/'#### N') as a user turn and
    an assistant turn in the reasoning format (`lmforge.tasks.reasoning`); without a trace the think block is
    empty, so the model learns the format and the answer, and GRPO's format reward still holds."""
    try:
        task = parse_task(record, where)
    except TaskFileError as e:
        raise SFTDataError(str(e)) from None
    content = DEFAULT_FORMAT.render(task["reasoning"] or "", task["answer"])
    return [{"role": "user", "content": task["prompt"]}, {"role": "assistant", "content": content}]


def default_system_message(tokenizer: Any) -> dict[str, str] | None:
    """The system turn the tokenizer's chat template puts before a chat that has none, or None. SmolLM2's template
    adds "You are a helpful AI assistant named SmolLM, trained by Hugging Face", Qwen2.5's its own; lmforge's
    template adds none. Read by rendering a one-message chat, so any ChatML template is covered."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    probe = "\x00probe\x00"  # cannot occur in a real system prompt
    text = tokenizer.apply_chat_template([{"role": "user", "content": probe}], tokenize=False)
    head, end = f"{IM_START}system\n", text.find(IM_END)
    if not text.startswith(head) or end < 0 or probe in text[:end]:
        return None
    return {"role": "system", "content": text[len(head):end]}


def _encode_conversation(messages: list[dict[str, str]], encode, im_start: int, im_end: int) -> _Conversation:
    """ChatML ids piece by piece: header | content | <|im_end|> | "\\n"; loss on the assistant's
    content and its <|im_end|> (the header is given at inference, the "\\n" is never generated)."""
    ids: list[int] = []
    mask: list[bool] = []
    newline = encode("\n")
    for m in messages:
        header = [im_start] + encode(m["role"] + "\n")
        body = encode(message_text(m)) + [im_end]
        learn = m["role"] == LOSS_ROLE
        ids += header + body + newline
        mask += [False] * len(header) + [learn] * len(body) + [False] * len(newline)
    return _Conversation(torch.tensor(ids, dtype=torch.int32), torch.tensor(mask, dtype=torch.bool))


def _pack_next_fit(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Rows of conversation indices, in file order, opening a new row when the next does not fit."""
    rows: list[list[int]] = []
    used = seq_len  # forces a first row
    for i, n in enumerate(lengths):
        if used + n > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


class SFTLoader:
    """Endless (B, T) batches of chat data with assistant-only labels; see the module docstring."""

    def __init__(self, path: str | os.PathLike, tokenizer: Any, seq_len: int, batch_size: int,
                 seed: int = 0, packed: bool = True, rank: int = 0, world_size: int = 1,
                 device: str | torch.device = "cpu"):
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.path, self.seq_len, self.batch_size = os.fspath(path), seq_len, batch_size
        self.seed, self.packed, self.rank, self.world_size = seed, packed, rank, world_size
        self.device = torch.device(device)
        self.pad_id = pad_id(tokenizer)
        self.data_hash = sha256_file(self.path)
        self.stats = SFTStats()
        self._conversations = self._read(tokenizer)
        lengths = [len(c.ids) - 1 for c in self._conversations]  # positions each one fills
        self._rows = _pack_next_fit(lengths, seq_len) if packed else [[i] for i in range(len(lengths))]
        self.stats.rows = len(self._rows)
        self.stats.padding_tokens = self.stats.rows * seq_len - self.stats.tokens
        self.global_batch = batch_size * world_size
        self.steps_per_epoch = len(self._rows) // self.global_batch
        if self.steps_per_epoch == 0:
            raise ValueError(f"{self.path}: {len(self._rows)} rows (seq_len {seq_len}, packed={packed}) are "
                             f"fewer than one global batch (batch_size {batch_size} x world_size "
                             f"{world_size}); use a smaller batch, or more data")
        self.epoch, self.step = 0, 0
        self._order_epoch, self._order = -1, np.zeros(0, np.int64)

    @property
    def tokens_per_batch(self) -> int:
        """Positions per batch on this rank (padding included), as the pretraining loader counts."""
        return self.batch_size * self.seq_len

    # ---- reading --------------------------------------------------------------------------------

    def _read(self, tokenizer: Any) -> list[_Conversation]:
        im_start, im_end = tokenizer.convert_tokens_to_ids(IM_START), tokenizer.convert_tokens_to_ids(IM_END)
        cache: dict[str, list[int]] = {}  # role headers and "\n" repeat on every message

        def encode(text: str) -> list[int]:
            if text in cache:
                return cache[text]
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(text) < 32:
                cache[text] = ids
            return ids

        conversations: list[_Conversation] = []
        system = default_system_message(tokenizer)  # what the template adds to a chat without a system turn
        with open(self.path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                messages = parse_messages(line, self.path, lineno)
                if system and messages[0]["role"] != "system":
                    messages = [system, *messages]
                conv = _encode_conversation(messages, encode, im_start, im_end)
                if len(conv.ids) > self.seq_len + 1:
                    self.stats.truncated += 1
                    conv = _Conversation(conv.ids[:self.seq_len + 1], conv.loss_mask[:self.seq_len + 1])
                n_loss = int(conv.loss_mask[1:].sum())  # token 0 is never a target
                if n_loss == 0:
                    self.stats.without_assistant += 1
                    continue
                conversations.append(conv)
                self.stats.assistant_tokens += n_loss
                self.stats.tokens += len(conv.ids) - 1
        self.stats.conversations = len(conversations)
        if self.stats.truncated:
            warnings.warn(f"{self.path}: {self.stats.truncated} conversation(s) longer than seq_len+1="
                          f"{self.seq_len + 1} tokens were truncated", stacklevel=3)
        if self.stats.without_assistant:
            warnings.warn(f"{self.path}: {self.stats.without_assistant} conversation(s) had no assistant "
                          "token (after truncation) and were skipped", stacklevel=3)
        if not conversations:
            raise SFTDataError(f"{self.path}: no conversation has an assistant token within its first "
                               f"seq_len+1={self.seq_len + 1} tokens; nothing to train on")
        return conversations

    # ---- rows and batches -----------------------------------------------------------------------

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            self._order = np.random.default_rng(self.seed + self.epoch).permutation(len(self._rows))
            self._order_epoch = self.epoch
        return self._order

    def _row(self, row: int) -> tuple[torch.Tensor, ...]:
        """(input_ids, labels, doc_ids, position_ids), each (T,), for one packed or padded row."""
        T = self.seq_len
        input_ids = torch.full((T,), self.pad_id, dtype=torch.long)
        labels = torch.full((T,), IGNORE_INDEX, dtype=torch.long)
        doc_ids = torch.empty(T, dtype=torch.long)
        position_ids = torch.empty(T, dtype=torch.long)
        start = 0
        for doc, i in enumerate(self._rows[row]):
            conv = self._conversations[i]
            n = len(conv.ids) - 1
            input_ids[start:start + n] = conv.ids[:-1]
            # shift: position t predicts token t+1, which carries loss iff it is the assistant's
            labels[start:start + n] = torch.where(conv.loss_mask[1:], conv.ids[1:].long(), IGNORE_INDEX)
            doc_ids[start:start + n] = doc
            position_ids[start:start + n] = torch.arange(n)
            start += n
        # padding is a document of its own, so no real token ever attends to it
        doc_ids[start:] = len(self._rows[row])
        position_ids[start:] = torch.arange(T - start)
        return input_ids, labels, doc_ids, position_ids

    def __iter__(self) -> SFTLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.step >= self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        lo = self.step * self.global_batch
        mine = self._epoch_order()[lo:lo + self.global_batch][self.rank::self.world_size]
        rows = [self._row(int(i)) for i in mine]
        self.step += 1
        names = ("input_ids", "labels", "doc_ids", "position_ids")
        return {name: torch.stack(col).to(self.device) for name, col in zip(names, zip(*rows))}

    # ---- resume ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where the next batch comes from (JSON-safe); `load_state_dict` of it resumes exactly."""
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed, "global_batch": self.global_batch,
                "num_rows": len(self._rows), "seq_len": self.seq_len, "packed": self.packed,
                "data_hash": self.data_hash}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` left off; refuses a state taken on other data or another layout."""
        mine = self.state_dict()
        for key in ("seed", "global_batch", "num_rows", "seq_len", "packed", "data_hash"):
            if state[key] != mine[key]:
                raise ValueError(f"SFT loader state has {key}={state[key]!r} but this loader has {mine[key]!r} "
                                 f"({self.path}); resume with the same file, seed, seq_len, packing and "
                                 "batch_size x world_size")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
