"""Speculative decoding: propose K tokens cheaply, verify them in the target's one forward, keep the
longest prefix the target agrees with (vLLM v1's `spec_decode/` and `sample/rejection_sampler.py`).

Two proposers, chosen by `EngineConfig.speculative_method`:

* `ngram` (prompt lookup, no second model): the last n tokens (n from `ngram_prompt_lookup_max` down
  to `ngram_prompt_lookup_min`) are looked up earlier in the sequence (prompt + output); the K tokens
  that followed their most recent earlier occurrence are the proposal (a copy that reaches the end of
  the sequence goes on copying what it just proposed: a loop of period p proposes K tokens, not p).
  Its draft distribution q is one-hot.
* `draft` (`speculative_model`): a small model with the target's vocabulary runs K single-token steps
  over its own paged KV pool (its own `ModelRunner` and a `BlockManager` without prefix caching; each
  sequence holds a `DraftView` of its draft-side blocks). Greedy rows take the draft's argmax; sampled
  rows sample from the draft's distribution q under the request's temperature / top-k / top-p / min-p.

The engine schedules a decoding sequence's last token plus its K proposals as K+1 tokens of the one
flat batch; their K/V are all written, and the K+1 logits rows come back. `verify` then applies the
standard rule (Leviathan et al. 2023, Chen et al. 2023): greedy, accept while the draft equals the
target's argmax, then the target's own next token; sampled, accept d with probability min(1, p(d)/q(d)),
on a rejection sample from norm(max(0, p - q)), and after K acceptances sample the bonus token from p.
So greedy output is the plain engine's token for token, and sampled output has the target's
distribution. A rejected draft's K/V slot is simply overwritten later: the sequence's
`num_computed_tokens` only counts accepted tokens.

Sequences whose next token depends on more than the target's logits row and the sampling filters
(repetition / presence / frequency penalties, logit_bias, allowed_token_ids, bad_words, structured outputs,
min_tokens not yet reached, logprobs asked for) are decoded plainly, one token a step, in the same batch.

`check_speculative` checks the flags against the models before anything loads (`lmforge serve` calls it
before it opens its port, `SpecDecoder` again for offline callers): the draft folder exists, its vocabulary
is the target's, and K proposals plus the target's own token fit both the context and one step's token
budget (K = 1,000 on a 512-token context made every step hundreds of draft forwards long, and an
abandoned request's abort waited for the step to end).

This module knows nothing about scheduling policy, text or HTTP.

Shape legend: K proposals of one sequence, V vocabulary, B sequences drafting together.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from lmforge.model.checkpoint import read_hf_config
from lmforge.quant import load_pretrained
from lmforge.quant.load import is_gguf

from .block_manager import BlockManager
from .config import EngineConfig
from .model_runner import ModelRunner
from .sampler import Sampler
from .scheduler import ScheduledSeq
from .sequence import Sequence


def spec_eligible(seq: Sequence) -> bool:
    """Whether the target's next-token distribution for `seq` is a function of one logits row alone
    (what `verify` assumes); otherwise the sequence decodes plainly."""
    p = seq.sampling_params
    return (seq.grammar is None and p.logprobs is None and not p.logit_bias and p.repetition_penalty == 1.0
            and p.allowed_token_ids is None and not seq.bad_words_token_ids
            and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and seq.num_output_tokens >= p.min_tokens)


def check_speculative(target: str, draft: str | None, k: int, max_model_len: int | None,
                      max_num_batched_tokens: int) -> None:
    """ValueError naming the flag (vLLM's names) when the speculative settings cannot run on `target`: a
    draft folder without config.json, a draft of another vocabulary (size, or token -> id when both folders
    hold a tokenizer.json), or K drafts + 1 target token beyond the context (less a one-token prompt) or
    one step's token budget. Reads configs only."""
    vocab, context = _vocab_and_context(target)
    context = max_model_len or context
    if k + 2 > context:
        raise ValueError(f"--num-speculative-tokens {k}: a {context}-token context holds at most {context - 2} "
                         "proposals (one prompt token, the proposals and the target's own token); use a few, 2 to 8")
    if k + 1 > max_num_batched_tokens:
        raise ValueError(f"--num-speculative-tokens {k}: a verification schedules {k + 1} tokens, more than one step "
                         f"takes (--max-num-batched-tokens {max_num_batched_tokens})")
    if draft is None:
        return
    path = Path(draft)
    if not (path / "config.json").is_file():
        raise ValueError(f"--speculative-model {path}: no config.json; pass a Hugging Face layout model directory "
                         "(a small model with the target's tokenizer)")
    draft_vocab = read_hf_config(path).get("vocab_size")
    if draft_vocab != vocab:
        raise ValueError(f"--speculative-model {path}: vocabulary of {draft_vocab} tokens, the target's has {vocab}; "
                         "the draft must share the target's tokenizer")
    ours, theirs = _tokenizer_vocab(Path(target)), _tokenizer_vocab(path)
    if ours is not None and theirs is not None and ours != theirs:
        raise ValueError(f"--speculative-model {path}: its tokenizer.json maps tokens to other ids than the target's; "
                         "the draft must share the target's tokenizer")


def _vocab_and_context(model: str) -> tuple[int | None, int]:
    if is_gguf(model):
        from lmforge.quant.gguf_file import open_gguf  # deferred: only a GGUF target reads its header here
        from lmforge.quant.gguf_load import hf_config

        f = open_gguf(model)
        cfg = hf_config(f.metadata, Path(model), set(f.tensors))
    else:
        cfg = read_hf_config(model)
    return cfg.get("vocab_size"), cfg.get("max_position_embeddings", 2048)


def _tokenizer_vocab(folder: Path) -> dict | None:
    file = folder / "tokenizer.json"
    if folder.suffix == ".gguf" or not file.is_file():
        return None
    try:
        return json.loads(file.read_text()).get("model", {}).get("vocab")
    except (OSError, ValueError):
        return None


class NgramProposer:
    """Prompt lookup: the tokens that followed the most recent earlier occurrence of the context's suffix."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        ids = np.asarray(token_ids, dtype=np.int64)
        L = len(ids)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            windows_WN = np.lib.stride_tricks.sliding_window_view(ids[:L - 1], n)  # starts 0..L-1-n
            hits = np.flatnonzero((windows_WN == ids[L - n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # the token after the most recent earlier occurrence
                out = ids[start:start + k].tolist()
                while len(out) < k:  # the copy runs into the present: it goes on copying itself (a loop)
                    out.append(out[len(out) - (L - start)])
                return out
        return []


class DraftView:
    """A sequence as the draft model's runner and block manager see it: its tokens (plus the draft's
    own proposals), how many of them have draft K/V, and its draft-pool blocks."""

    pooling = None  # never a pooling request (the model runner asks)

    def __init__(self):
        self.token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class DraftProposer:
    """K draft-model steps for every proposing sequence at once: the first step catches each draft view
    up with its sequence (the prompt on first use, then the tokens accepted last step), the others feed
    back one proposed token each."""

    def __init__(self, config: EngineConfig, num_blocks: int, target_vocab: int, sampler: Sampler):
        path = Path(config.speculative_model)
        model = load_pretrained(path, dtype=config.dtype, device=config.device)
        if model.config.vocab_size != target_vocab:
            raise ValueError(f"--speculative-model {path}: vocabulary of {model.config.vocab_size} tokens, the "
                             f"target's has {target_vocab}; the draft must share the target's tokenizer")
        reference = config.attention == "reference"
        self.runner = ModelRunner(model, num_blocks, config.block_size, reference, config.pack_weights,
                                  config.cpu_kernels)
        runs = not reference and self.runner.attn.contiguous_runs
        self.block_manager = BlockManager(num_blocks, config.block_size, False, runs)
        self.sampler = sampler

    def release(self, seq: Sequence) -> None:
        if seq.draft_view is not None:
            self.block_manager.free_seq(seq.draft_view)
            seq.draft_view = None

    def propose(self, seqs: list[Sequence], ks: list[int]) -> None:
        """Sets `spec_token_ids` (and, for sampled rows, `spec_probs`: the draft's q rows, (K, V))."""
        todo = [(s, k) for s, k in zip(seqs, ks) if self._catch_up(s, k)]
        step = [ScheduledSeq(s.draft_view, s.draft_view.num_tokens - s.draft_view.num_computed_tokens)
                for s, _ in todo]
        for i in range(max((k for _, k in todo), default=0)):
            if i:
                todo = [(s, k) for s, k in todo if k > i]
                step = [ScheduledSeq(s.draft_view, 1) for s, _ in todo]
            tokens, probs = self._draft_tokens(self.runner.run(step), [s for s, _ in todo])
            for (s, _), t, q in zip(todo, tokens, probs):
                s.spec_token_ids.append(t)
                if q is not None:
                    s.spec_probs.append(q)
                s.draft_view.token_ids.append(t)
            for st in step:
                st.seq.num_computed_tokens += st.num_new_tokens

    def _catch_up(self, seq: Sequence, k: int) -> bool:
        """Point the view at the sequence's tokens and give it blocks for the K draft steps; False (no
        proposal this step) when the draft pool is full."""
        view = seq.draft_view = seq.draft_view or DraftView()
        view.num_computed_tokens = min(view.num_computed_tokens, seq.num_tokens - 1)
        view.token_ids = list(seq.token_ids)
        need = view.num_tokens - view.num_computed_tokens + k - 1  # catch-up + the K-1 fed-back drafts
        if self.block_manager.blocks_needed(view, need) > self.block_manager.num_free_blocks:
            return False
        self.block_manager.allocate(view, need)
        return True

    def _draft_tokens(self, logits_BV: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list]:
        """Greedy rows: the draft's argmax; sampled rows: a draw from q (the request's filters applied)."""
        logits_BV = logits_BV.float()
        greedy = [s.sampling_params.greedy for s in seqs]
        tokens = logits_BV.max(dim=-1).indices.tolist()  # the sampler's argmax (first index on ties)
        probs: list = [None] * len(seqs)
        if all(greedy):
            return tokens, probs
        q_BV = self.sampler.process_logits(logits_BV, seqs).softmax(dim=-1)
        for i, s in enumerate(seqs):
            if not greedy[i]:
                tokens[i] = int(torch.multinomial(q_BV[i], 1, generator=s.generator))
                probs[i] = q_BV[i]
        return tokens, probs


class SpecDecoder:
    """The engine's speculative-decoding side: proposals before a step, verification after it, counters."""

    def __init__(self, config: EngineConfig, num_blocks: int, target_vocab: int, sampler: Sampler,
                 max_model_len: int):
        self.k, self.sampler, self.max_model_len = config.num_speculative_tokens, sampler, max_model_len
        try:
            check_speculative(config.model, config.speculative_model, self.k, max_model_len,
                              config.max_num_batched_tokens)
        except ValueError as e:  # offline callers: the EngineConfig field
            flag = str(e).split(" ", 1)[0].removeprefix("--").replace("-", "_")
            raise ValueError(f"EngineConfig.{flag}={getattr(config, flag)}: {str(e).split(': ', 1)[1]}") from None
        self.method = config.speculative_method
        self.ngram = NgramProposer(config.ngram_prompt_lookup_min, config.ngram_prompt_lookup_max)
        self.draft = DraftProposer(config, num_blocks, target_vocab, sampler) if self.method == "draft" else None
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k

    def budget(self, seq: Sequence) -> int:
        """Proposals worth making: none unless decoding and eligible; never past max_tokens or
        max_model_len (the target adds one token of its own after the accepted ones)."""
        if seq.num_tokens - seq.num_computed_tokens != 1 or not spec_eligible(seq):
            return 0
        return max(0, min(self.k, seq.max_tokens - seq.num_output_tokens - 1,
                          self.max_model_len - seq.num_tokens - 1))

    def propose(self, running: list[Sequence]) -> None:
        for seq in running:
            seq.spec_token_ids, seq.spec_probs = [], []
        seqs = [(s, self.budget(s)) for s in running]
        seqs = [(s, k) for s, k in seqs if k > 0]
        if self.draft is not None:
            self.draft.propose([s for s, _ in seqs], [k for _, k in seqs])
            return
        for seq, k in seqs:
            seq.spec_token_ids = self.ngram.propose(seq.token_ids, k)

    def release(self, seq: Sequence) -> None:
        seq.spec_token_ids, seq.spec_probs = [], []
        if self.draft is not None:
            self.draft.release(seq)

    def verify(self, seqs: list[Sequence], drafts: list[list[int]], logits_RV: torch.Tensor) -> list[list[int]]:
        """The tokens each sequence keeps: the accepted drafts, then one of the target's. `logits_RV`
        holds, per sequence in order, len(drafts)+1 rows: the target's logits at the last token and at
        each draft."""
        logits_RV = logits_RV.float()
        argmax_R = logits_RV.max(dim=-1).indices.tolist()  # the sampler's argmax (first index on ties)
        out, row = [], 0
        for seq, d in zip(seqs, drafts):
            rows = slice(row, row + len(d) + 1)
            if seq.sampling_params.greedy:
                kept = greedy_accept(d, argmax_R[rows])
            else:
                p_KV = self.sampler.process_logits(logits_RV[rows], [seq] * (len(d) + 1)).softmax(dim=-1)
                q_KV = torch.stack(seq.spec_probs[:len(d)]) if seq.spec_probs else None
                kept = rejection_sample(d, p_KV, q_KV, seq.generator)
            self._count(len(d), len(kept) - 1)
            out.append(kept)
            row += len(d) + 1
        return out

    def _count(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def stats(self) -> dict:
        """vLLM's spec-decode counters, plus the acceptance rate and the mean tokens a verification yields."""
        d = self.num_drafts
        return dict(spec_decode_method=self.method, spec_decode_num_speculative_tokens=self.k,
                    spec_decode_num_drafts=d, spec_decode_num_draft_tokens=self.num_draft_tokens,
                    spec_decode_num_accepted_tokens=self.num_accepted_tokens,
                    spec_decode_num_accepted_tokens_per_pos=list(self.accepted_per_pos),
                    spec_decode_acceptance_rate=self.num_accepted_tokens / self.num_draft_tokens
                    if self.num_draft_tokens else 0.0,
                    spec_decode_mean_tokens_per_step=1 + self.num_accepted_tokens / d if d else 0.0)


def greedy_accept(drafts: list[int], target: list[int]) -> list[int]:
    """The drafts while they equal the target's argmax at their position, then the target's token
    where they first differ (or after the last): `target` has len(drafts) + 1 entries."""
    m = 0
    while m < len(drafts) and drafts[m] == target[m]:
        m += 1
    return drafts[:m] + [target[m]]


def rejection_sample(drafts: list[int], p_KV: torch.Tensor, q_KV: torch.Tensor | None,
                     generator: torch.Generator | None) -> list[int]:
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1). p_KV: the target's probabilities at
    the K+1 positions; q_KV: the draft's at the first K (None: one-hot on the drafts, as for ngram).
    Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); on the first rejection draw from
    norm(max(0, p_i - q_i)) and stop; after K acceptances draw the bonus token from p_K."""
    kept = []
    for i, d in enumerate(drafts):
        q_i = q_KV[i] if q_KV is not None else torch.nn.functional.one_hot(
            torch.tensor(d, device=p_KV.device), p_KV.shape[-1]).to(p_KV.dtype)
        u = torch.rand((), generator=generator, device=p_KV.device)
        if bool(u * q_i[d] < p_KV[i, d]):  # u < p/q without dividing by a tiny q
            kept.append(d)
            continue
        residual_V = (p_KV[i] - q_i).clamp_(min=0)
        if not bool(residual_V.sum() > 0):  # p == q up to rounding: a rejection was a fluke
            residual_V = p_KV[i]
        kept.append(int(torch.multinomial(residual_V, 1, generator=generator)))
        return kept
    kept.append(int(torch.multinomial(p_KV[len(drafts)], 1, generator=generator)))
    return kept
