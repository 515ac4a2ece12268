"""Structured outputs: grammar-constrained decoding with llguidance, as vLLM's "guidance" backend does
(`vllm/v1/structured_output/backend_guidance.py`).

A request's `StructuredOutputsParams` (a JSON schema, JSON mode, a regex, a list of choices or a Lark /
GBNF grammar) is compiled once per distinct spec into an `LLMatcher` against the model's tokenizer and
kept in an LRU cache; each sequence gets its own copy (`Grammar`). Every engine step, the constrained
rows' matchers fill a token bitmask (a bit per vocabulary entry, 32 to an int32) that becomes a boolean
`(S, V)` mask the `Sampler` applies before anything else; unconstrained rows in the same batch get
all-ones words, so they are left alone. After sampling, each matcher consumes its row's token; when a
matcher is stopped (nothing but EOS could follow) the engine finishes the sequence with reason "stop"
without spending a step on EOS.

A spec is admitted only if it can run: it compiles, and a dry run of its first `DRY_RUN_TOKENS` tokens
(each step the first token its mask allows) hits none of llguidance's limits (2,000 Earley items in a row,
the lexer's fuel) and no dead end (a `$ref` that only refers back to itself): those used to compile, then
end the request at its first token with finish_reason "abort". llguidance's errors are non-verbose here
(`verbose_errors=False`), so no message of ours carries a piece of a request's grammar into a log.

The matcher's state is a function of the sequence's output tokens only, so the paged prefix cache
(which shares prompt K/V) and preemption by recompute (which keeps the output tokens and recomputes
their K/V) leave it valid: nothing to reset or replay.

It knows nothing about scheduling or the model; it sees a Hugging Face fast tokenizer, the logits'
vocabulary size, the EOS ids, and sequences with a `grammar` attribute.

    python -m pytest -q tests/test_engine_structured.py

Shape legend: S = rows sampling this step, W = bitmask words per row ((V + 31) // 32), V = vocabulary.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .sampling_params import JSON_WHITESPACE, StructuredOutputsParams

GRAMMAR_CACHE_SIZE = 256  # distinct specs kept compiled; a compile is ~0.1-1 ms for typical schemas
PARALLEL_MIN_ROWS, PARALLEL_MIN_CPUS = 8, 8  # when llguidance's thread pool fills the masks
DRY_RUN_TOKENS = 8  # tokens walked at admission: the issue-43 grammars (3,000 choices, a 5,000-way rule, a
# nested counted regex, a $ref cycle) all fail at the first; an ordinary schema's walk costs well under 1 ms


@functools.cache
def _llguidance() -> Any:
    """The llguidance package with its `hf` and `torch` helpers, imported on first use."""
    import llguidance.hf  # deferred: optional heavy dependency, loaded only for constrained requests
    import llguidance.torch  # noqa: F401  (registers llguidance.torch)
    return llguidance


@functools.cache
def _limits() -> Any:
    """llguidance's default limits, with errors that never quote the grammar or the parser's state."""
    return _llguidance().LLParserLimits(verbose_errors=False)


class Grammar:
    """One sequence's matcher: which tokens may come next, advanced by each sampled token."""

    def __init__(self, matcher: Any):
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and the matcher's error state) if the grammar refuses it."""
        return self.matcher.consume_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and nothing but EOS may follow (or the matcher is in error)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


class StructuredOutputManager:
    """Compiles specs (cached), hands out per-sequence `Grammar`s, builds each step's token mask."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = GRAMMAR_CACHE_SIZE):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer = None  # built on the first constrained request: ~1 s for a 150k vocabulary
        self._executor = None
        self._bitmask_SW: torch.Tensor | None = None
        self._compile = functools.lru_cache(maxsize=cache_size)(self._compile_uncached)

    def check(self, params: StructuredOutputsParams) -> None:
        """Compile (or find in the cache); ValueError naming the problem for a spec that cannot compile."""
        self._compile(*_cache_key(params))

    def grammar_for(self, params: StructuredOutputsParams) -> Grammar:
        """A fresh matcher for one sequence (a copy of the cached, compiled one)."""
        return Grammar(self._compile(*_cache_key(params)).deep_copy())

    @property
    def ll_tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs the model's tokenizer, and this model folder has none")
            n_vocab = max(self.vocab_size, len(self.tokenizer))
            eos = self.eos_token_ids or self.tokenizer.eos_token_id
            try:
                self._ll_tokenizer = _llguidance().hf.from_tokenizer(self.tokenizer, n_vocab, eos_token=eos)
            except ValueError as e:  # a slow (sentencepiece-only) tokenizer
                raise ValueError(f"structured_outputs needs a fast tokenizer (tokenizer.json): {e}") from None
        return self._ll_tokenizer

    def _compile_uncached(self, kind: str, spec: str, whitespace: bool | str) -> Any:
        """The template matcher for one spec; copies of it serve the sequences."""
        llguidance = _llguidance()
        grammar = _serialize(llguidance, kind, spec, whitespace)
        try:
            matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=_limits())
        except (ValueError, RuntimeError) as e:  # documented as "never raises", but be safe
            raise ValueError(f"structured_outputs.{kind}: {_describe(kind, str(e))}") from None
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{kind}: {_describe(kind, matcher.get_error())}")
        error = dry_run(matcher.deep_copy(), self.eos_token_ids)
        if error:
            raise ValueError(f"structured_outputs.{kind}: this grammar cannot run: {_describe(kind, error)}")
        return matcher

    def banned_tokens(self, seqs: Sequence[Any], device: torch.device) -> torch.Tensor | None:
        """(S, V) bool, True where a constrained row's grammar forbids the token; None if no row is constrained.

        The matchers write their bits straight into a CPU int32 buffer (pinned when CUDA is present),
        which travels to the device in one copy and is unpacked there.
        """
        rows = [(s.grammar.matcher, i) for i, s in enumerate(seqs) if getattr(s, "grammar", None) is not None]
        if not rows:
            return None
        bitmask_SW = self._bitmask(len(seqs))
        bitmask_SW.fill_(-1)  # all bits set: unconstrained rows ban nothing
        self._fill(rows, bitmask_SW)
        return self._unpack_banned(bitmask_SW.to(device, non_blocking=True))

    def _bitmask(self, S: int) -> torch.Tensor:
        if self._bitmask_SW is None or self._bitmask_SW.shape[0] < S:
            size = max(S, 2 * (0 if self._bitmask_SW is None else self._bitmask_SW.shape[0]), 8)
            self._bitmask_SW = _llguidance().torch.allocate_token_bitmask(size, self.ll_tokenizer.vocab_size)
        return self._bitmask_SW[:S]

    def _fill(self, rows: list[tuple[Any, int]], bitmask_SW: torch.Tensor) -> None:
        """One mask per (matcher, row). llguidance's thread pool pays off only with spare cores: on a busy
        2-core machine it took 330 us a row against 36 us one after the other (16 rows, JSON schema)."""
        llguidance = _llguidance()
        if len(rows) < PARALLEL_MIN_ROWS or _cpus() < PARALLEL_MIN_CPUS:
            for matcher, i in rows:
                llguidance.torch.fill_next_token_bitmask(matcher, bitmask_SW, i)
            return
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        llguidance.torch.fill_next_token_bitmask_par(self._executor, rows, bitmask_SW)

    def _unpack_banned(self, bitmask_SW: torch.Tensor) -> torch.Tensor:
        """Not llguidance's `apply_token_bitmask_inplace`: a `torch.compile`d kernel, which needs a compiler
        on the serving machine and warms up per shape. On a CPU numpy's `unpackbits` took 0.17 ms for 16
        rows of a 131k vocabulary, the tensor ops 3.7 ms; on a GPU the tensor ops run where the logits are."""
        if bitmask_SW.device.type == "cpu" and sys.byteorder == "little":
            return unpack_banned_numpy(bitmask_SW, self.vocab_size)
        return unpack_banned_torch(bitmask_SW, self.vocab_size)


def unpack_banned_numpy(bitmask_SW: torch.Tensor, V: int) -> torch.Tensor:
    """int32 words (CPU) -> (S, V) bool, True where the bit is clear: bit b of word w is token 32 w + b
    (llguidance's layout), so on a little-endian machine the words' bytes unpack least significant bit first."""
    bits_SV = np.unpackbits(bitmask_SW.numpy().view(np.uint8), axis=1, count=V, bitorder="little")
    return torch.from_numpy(bits_SV == 0)


def unpack_banned_torch(bitmask_SW: torch.Tensor, V: int) -> torch.Tensor:
    """The same on any device, in two tensor ops."""
    S, W = bitmask_SW.shape
    banned_SW32 = (bitmask_SW.unsqueeze(-1) & _bit_values(bitmask_SW.device)) == 0
    return banned_SW32.view(S, W * 32)[:, :V]


@functools.cache
def _bit_values(device: torch.device) -> torch.Tensor:
    """(32,) int32: 1 << b; bit 31 is the sign bit."""
    return torch.tensor([1 << b for b in range(31)] + [-(1 << 31)], dtype=torch.int32, device=device)


def dry_run(matcher: Any, eos_token_ids: Sequence[int], steps: int = DRY_RUN_TOKENS) -> str:
    """llguidance's error after walking `matcher` (a copy: it is consumed) for up to `steps` tokens, each
    the first its mask allows other than EOS; "" when the walk ends cleanly (or the grammar is complete)."""
    for _ in range(steps):
        if matcher.is_stopped():
            break
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        if matcher.is_error():
            break
        allowed = np.flatnonzero(bits)
        allowed = allowed[~np.isin(allowed, eos_token_ids)]
        if not len(allowed):
            break
        matcher.consume_token(int(allowed[0]))
    return matcher.get_error() if matcher.is_error() else ""


@functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _check_key(kind: str, spec: str, whitespace: bool | str) -> None:
    llguidance = _llguidance()
    error = llguidance.LLMatcher.validate_grammar(_serialize(llguidance, kind, spec, whitespace), limits=_limits())
    if error:
        raise ValueError(f"structured_outputs.{kind}: {_describe(kind, error)}")


@functools.lru_cache(maxsize=4)  # one per served tokenizer (a reload brings a new one)
def _manager_for(tokenizer: Any, vocab_size: int) -> StructuredOutputManager:
    eos = getattr(tokenizer, "eos_token_id", None)
    return StructuredOutputManager(tokenizer, vocab_size, [] if eos is None else [eos])


def check_spec(params: StructuredOutputsParams, tokenizer: Any = None, vocab_size: int | None = None) -> None:
    """ValueError naming the problem when `params` cannot compile or, given the model's tokenizer, cannot
    run (the engine's own compile and dry run): what a server checks before it answers 200 (a stream's
    status cannot change once its headers are out), as vLLM's front end does. Cached per spec, like the
    compile; call it from one thread per tokenizer (the server's tokenize worker)."""
    _check_key(*_cache_key(params))
    if tokenizer is not None:
        _manager_for(tokenizer, vocab_size or len(tokenizer)).check(params)


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _cache_key(params: StructuredOutputsParams) -> tuple[str, str, bool | str]:
    """A hashable form of the spec. Key order is kept: it is the order the properties are generated in."""
    spec = params.spec
    if params.kind == "json":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json: not valid JSON ({e})") from None
        spec = json.dumps(spec)
    elif params.kind == "choice":
        spec = json.dumps(spec)
    elif params.kind == "json_object":
        spec = ""
    # JSON whitespace: False = none, a string = that regex per separator (by default JSON_WHITESPACE)
    whitespace = False if params.disable_any_whitespace else params.whitespace_pattern or JSON_WHITESPACE
    return params.kind, spec, whitespace


def _serialize(llguidance: Any, kind: str, spec: str, whitespace: bool | str) -> str:
    """llguidance's grammar text for one spec (its `grammar_from`, with the JSON options vLLM passes)."""
    if isinstance(whitespace, str):
        options = {"whitespace_flexible": True, "whitespace_pattern": whitespace}
    else:
        options = {"whitespace_flexible": whitespace}
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=options)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
        return llguidance.grammar_from("choice" if kind == "choice" else kind, spec)
    except ValueError as e:
        raise ValueError(f"structured_outputs.{kind}: {e}") from None


def _describe(kind: str, error: str) -> str:
    """llguidance's message, with the fix for the common case: a JSON-schema keyword it does not implement."""
    error = error.replace("<non-verbose/>", "").strip()
    if error == "NoExtensionBias":  # llguidance's word for a grammar that can produce no text at all
        return ("it matches no text at all (e.g. a $ref that refers only back to itself); give every "
                "recursion something to match")
    if error.startswith("Parser Error: Current row has"):
        return f"{error} (llguidance's limit: at most 2,000 alternatives at one point of the grammar)"
    if kind == "json" and error.startswith("Unimplemented keys"):
        return f"unsupported JSON schema feature: {error}; remove these keywords from the schema"
    return error
