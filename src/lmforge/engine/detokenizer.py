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
        self._stops = StopMatcher(sampling_params.stop) if sampling_params.stop else None
        # Nobody reads a final_only request's text before it ends, and without stop strings nothing
        # depends on it either: decode once at the end (one call instead of two per token; the
        # same text, since the windows of the incremental path add up to it).
        self.lazy = sampling_params.output_kind == "final_only" and self._stops is None

    def step(self, new_token_ids: list[int]) -> tuple[str, bool]:
        """Add tokens; return (text safe to stream now, whether a stop string matched)."""
        if self.tokenizer is None or self._finished:
            return "", self.stop_str is not None
        self._ids.extend(new_token_ids)
        if self.lazy:
            return "", False
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

    def catch_up(self) -> str:
        """The text the incremental path would have released by now (a lazy request that is aborted)."""
        if self.tokenizer is None or self._finished:
            return ""
        # the incremental path holds back only a trailing incomplete character
        self._append_and_check_stop(self._decode_new(final=True).rstrip("\ufffd"))
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
        match = self._stops.feed(new_text) if self._stops else None
        if match is None:
            return False
        end, self.stop_str = match  # end: where the match ends, counted from the start of new_text
        i = start + end - len(self.stop_str)
        self.text = self.text[: i + len(self.stop_str) if self.params.include_stop_str_in_output else i]
        self._finished = True
        return True

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        return self._stops.held_back() if self._stops else 0

    def _take(self, end: int) -> str:
        end = max(end, self._emitted)
        delta, self._emitted = self.text[self._emitted:end], end
        return delta


class StopMatcher:
    """Finds stop strings in text that arrives in pieces, in time linear in the text.

    One Knuth-Morris-Pratt automaton per stop string: its state is the length of the longest
    suffix of the text so far that is a prefix of that stop string, updated per character in
    amortized O(1). So a new piece of c characters costs O(c * number of stops), whatever the
    lengths of the stops, and `held_back` (how much to withhold from a stream because it may yet
    become a stop) is a max over the states. Re-searching a window and testing every prefix of
    every stop at each token instead costs O(sum of len(stop)**2) per token, which a request with
    many long stop strings turned into seconds per step for everyone sharing the batch.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = list(stops)
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)

    def feed(self, text: str) -> tuple[int, str] | None:
        """Consume `text`; return (end offset within `text`, stop) of the match that starts first
        among those completing inside it (the first listed on a tie), or None."""
        best: tuple[int, int, str] | None = None  # (start, end, stop)
        for k, stop in enumerate(self.stops):
            fail, q, n = self._fail[k], self._state[k], len(stop)
            for j, ch in enumerate(text):
                while q and stop[q] != ch:
                    q = fail[q - 1]
                if stop[q] == ch:
                    q += 1
                if q == n:
                    begin = j + 1 - n
                    if best is None or begin < best[0]:
                        best = (begin, j + 1, stop)
                    q = fail[q - 1]
                    break
            self._state[k] = q
        return None if best is None else (best[1], best[2])

    def held_back(self) -> int:
        return max(self._state, default=0)


def _failure(pattern: str) -> list[int]:
    """KMP failure function: fail[i] = length of the longest proper border of pattern[:i + 1]."""
    fail, q = [0] * len(pattern), 0
    for i in range(1, len(pattern)):
        while q and pattern[i] != pattern[q]:
            q = fail[q - 1]
        if pattern[i] == pattern[q]:
            q += 1
        fail[i] = q
    return fail
