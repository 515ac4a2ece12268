"""IncrementalDetokenizer: one request's token ids -> streamable text deltas and stop strings.

Two things make streaming harder than `tokenizer.decode(ids)`:

* a token may end inside a multi-byte UTF-8 character (byte-level BPE splits emoji and CJK
  across tokens). We decode a sliding window of tokens the way vLLM and HF's TextStreamer do:
  `prefix_offset..read_offset` is text already emitted, `read_offset..` is new; the new part
  is released only when the window's text does not end in U+FFFD (an incomplete character);
* a stop string may arrive split across tokens. Any suffix of the text that is a prefix of
  some stop string is held back until it either completes the stop (then the text is cut
  there) or stops being a possible prefix, so a stop string never leaks into a delta.

It knows nothing about sampling, max_tokens or EOS: the engine calls `step` with each new
token, finishes the request when `step` says a stop string matched, and calls `flush` when
the request ends for any other reason.

    python -m pytest -q tests/test_engine_detokenizer.py
"""

from __future__ import annotations

from typing import Any

from lmforge.engine.sampling_params import SamplingParams

# Prompt tokens decoded as left context, as in vLLM: enough for decoders that treat the first
# token of a text differently (SentencePiece's leading space), cheap for everything else.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, sampling_params: SamplingParams, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.params = sampling_params
        self.text = ""  # the output text so far (cut at the stop string once one matched)
        self.stop_str: str | None = None  # the stop string that matched, if any
        self._ids = list(prompt_token_ids)
        self._prefix_offset = max(len(self._ids) - PROMPT_CONTEXT_TOKENS, 0)
        self._read_offset = len(self._ids)
        self._emitted = 0  # characters of self.text already returned by step/flush
        self._finished = False

    def step(self, new_token_ids: list[int]) -> tuple[str, bool]:
        """Add tokens; return (text safe to stream now, whether a stop string matched)."""
        if self.tokenizer is None or self._finished:
            return "", self.stop_str is not None
        self._ids.extend(new_token_ids)
        new_text = self._decode_new(final=False)
        if self._append_and_check_stop(new_text):
            return self._take(len(self.text)), True
        return self._take(len(self.text) - self._held_back()), False

    def flush(self) -> str:
        """Release everything held back (incomplete characters, partial stop strings)."""
        if self.tokenizer is None or self._finished:
            return ""
        self._append_and_check_stop(self._decode_new(final=True))
        self._finished = True
        return self._take(len(self.text))

    def _decode(self, ids: list[int]) -> str:
        # No clean-up of tokenization spaces: it looks across token boundaries, so windowed
        # decodes would not add up to the decode of the whole sequence.
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _decode_new(self, final: bool) -> str:
        """Text of tokens from read_offset on, or "" while it ends in an incomplete character."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not final):
            # Nothing printable yet (a special token skipped) or a character still incomplete:
            # keep the window and retry with the next token.
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full_text[len(prefix_text):]

    def _append_and_check_stop(self, new_text: str) -> bool:
        """Append new text; on the earliest stop-string match cut `.text` and finish."""
        if not new_text:
            return False
        start = len(self.text)
        self.text += new_text
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            # A match must end inside the new text; earlier ones would have been caught before.
            i = self.text.find(stop, max(start - len(stop) + 1, 0))
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return False
        i, self.stop_str = best
        self.text = self.text[: i + len(self.stop_str) if self.params.include_stop_str_in_output else i]
        self._finished = True
        return True

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        held = 0
        for stop in self.params.stop:
            for k in range(min(len(stop) - 1, len(self.text)), held, -1):
                if self.text.endswith(stop[:k]):
                    held = k
                    break
        return held

    def _take(self, end: int) -> str:
        end = max(end, self._emitted)
        delta, self._emitted = self.text[self._emitted:end], end
        return delta
