"""`Scheduler`: the one rule. Each step spends a token budget on running sequences first (one
decode token, or the next prefill chunk), then on waiting ones in arrival order while blocks can
be allocated. Chunked prefill, prefix-cache hits and resumption after preemption all fall out of
`num_tokens - num_computed_tokens`. When a running sequence cannot get a block, the newest running
sequence is preempted by recompute: its blocks are freed, `num_computed_tokens` goes back to 0 and
it returns to the head of the waiting queue, keeping its generated tokens. A sequence still collecting
prompt logprobs reads nothing from the prefix cache (its every prompt position must be computed). A decoding sequence with
speculative drafts (`seq.spec_token_ids`) is given 1 + its drafts, as far as the budget and the free
blocks allow; only accepted drafts ever count as computed (`accept_spec`).

This module knows nothing about tensors, models, sampling or end conditions; it sees sequences
and a `BlockManager`. Requests that could never fit are refused by the engine before they get here,
so the only running sequence can always get its blocks.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens whose K/V this step computes, from seq.num_computed_tokens on (drafts included)
    spec_token_ids: list[int] = field(default_factory=list)  # speculative decoding: the drafts verified this step
    prompt_positions: range = range(0)  # positions whose logits give prompt logprobs (Sequence.prompt_logprob_positions)

    @property
    def samples(self) -> bool:  # the chunk reaches the last token: its logits give the next token
        return self.seq.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids) == self.seq.num_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is the newest
        self.num_preemptions = 0
        self.max_loras: int | None = None  # multi-LoRA: running sequences use at most this many adapters

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget, scheduled, preempted = self.max_num_batched_tokens, [], False
        bm, i = self.block_manager, 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            spec = self._spec_tokens(seq, n, budget)
            while bm.blocks_needed(seq, n) > bm.num_free_blocks and seq.status == SequenceStatus.RUNNING:
                self._preempt(self.running.pop())  # the newest; maybe seq itself
                preempted = True
            if seq.status != SequenceStatus.RUNNING:
                break
            bm.allocate(seq, n + len(spec))
            scheduled.append(ScheduledSeq(seq, n + len(spec), spec, seq.prompt_logprob_positions(n)))
            budget -= n + len(spec)
            i += 1
        # vLLM's rule: no admissions in a step that had to preempt (memory is tight)
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.wait_for is not None and not self._prompt_cached(seq.wait_for):
                break  # n > 1: let sample 0 fill the prompt's blocks, then share them
            if not self._lora_fits(seq):
                break  # its adapter needs a slot that running sequences hold: wait for one to finish
            hit_ids, hashes = bm.match_prefix(seq) if not seq.needs_prompt_logprobs else ([], [])
            n = min(seq.num_tokens - len(hit_ids) * bm.block_size, budget)
            if not bm.can_admit(seq, hit_ids, n):
                break
            self.waiting.popleft()
            bm.admit(seq, hit_ids, hashes)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            bm.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            seq.first_scheduled_time = seq.first_scheduled_time or time.time()
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, n, prompt_positions=seq.prompt_logprob_positions(n)))
            budget -= n
        return scheduled

    def _spec_tokens(self, seq: Sequence, n: int, budget: int) -> list[int]:
        """The drafts a decoding sequence verifies this step: what the budget and the free blocks allow
        (never a preemption for a draft); dropped from `seq` otherwise."""
        spec = seq.spec_token_ids[:budget - n] if n == seq.num_tokens - seq.num_computed_tokens == 1 else []
        while spec and self.block_manager.blocks_needed(seq, n + len(spec)) > self.block_manager.num_free_blocks:
            spec = spec[:-1]
        seq.spec_token_ids = spec
        return spec

    def _lora_fits(self, seq: Sequence) -> bool:
        """Admitting `seq` keeps the running sequences' adapters within `max_loras` (vLLM's rule), so the
        LoRA slots can always hold every adapter a step needs."""
        if self.max_loras is None or not seq.lora_int_id:
            return True
        active = {s.lora_int_id for s in self.running if s.lora_int_id}
        return seq.lora_int_id in active or len(active) < self.max_loras

    def _prompt_cached(self, seq: Sequence) -> bool:
        if not self.block_manager.enable_prefix_caching:
            return True
        full_prompt_blocks = (seq.num_prompt_tokens - 1) // self.block_manager.block_size
        return seq.is_finished or len(seq.block_hashes) >= full_prompt_blocks

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free_seq(seq)
        seq.spec_token_ids, seq.spec_probs = [], []
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update(self, scheduled: list[ScheduledSeq]) -> None:
        """After the forward: the scheduled tokens' K/V are in the pool; hash blocks that filled."""
        for s in scheduled:  # drafts' K/V count once the engine has accepted them (`accept_spec`)
            s.seq.num_computed_tokens += s.num_new_tokens - len(s.spec_token_ids)
            self.block_manager.cache_full_blocks(s.seq)

    def accept_spec(self, seq: Sequence) -> None:
        """After a verification appended the accepted drafts and the target's token: every token but
        that last one has its K/V in the pool (a rejected draft's slot is overwritten later)."""
        if not seq.is_finished:
            seq.num_computed_tokens = seq.num_tokens - 1
            self.block_manager.cache_full_blocks(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` (any status) and free its blocks at once."""
        if seq.is_finished:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free_seq(seq)
        seq.status, seq.finish_reason, seq.finished_time = SequenceStatus.FINISHED, reason, time.time()
