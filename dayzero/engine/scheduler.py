"""The scheduler: what runs this step. Policy only; the cache manager owns blocks and slots.

Invariant: at the start and end of every step, each RUNNING sequence holds a state slot and cache blocks
for at least its ``num_computed`` tokens, each WAITING sequence holds nothing, and the tokens scheduled
in one step never exceed ``max_num_batched_tokens``. A sequence is sampled only in a step that brings
``num_computed`` up to ``num_tokens``.

Each step first gives every running sequence its next tokens (one decode token, or the next prefill
chunk), oldest first; when blocks run out it preempts the youngest running sequence by recompute (its
cache is freed and it returns to the front of the queue with all its tokens, prompt and generated, to be
prefilled again). Then, if no sequence was preempted, it admits waiting sequences in arrival order while
token budget, sequence seats and cache remain, splitting long prompts into chunks (chunked prefill). A
sequence admitted with a cached prefix (``cache.match``) starts at that prefix; chunks end where the cache
manager takes state snapshots (``cache.chunk_end``). The later samples of an ``n > 1`` request wait until the
first has computed the prompt, and then share it from the prefix cache.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from dayzero.cache.manager import CacheManager
from dayzero.engine.request import Sequence, SeqStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens of this sequence computed this step

    @property
    def samples(self) -> bool:
        return self.seq.num_computed + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, cache: CacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._firsts: dict[str, Sequence] = {}  # request id -> its first sample, while it runs

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        if seq.index == 0:
            self._firsts[seq.request_id] = seq

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.hold:  # ends with the tokens in flight: nothing more to compute
                i += 1
                continue
            n = self._chunk(seq, budget)
            while not self.cache.grow(seq.seq_id, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                out.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
                continue
            break  # seq itself was preempted: nothing older is left to try
        if preempted:
            return out
        j = 0
        while j < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[j]
            if self._waits_for_sibling(seq):  # its request's first sample is still computing the shared prompt
                j += 1
                continue
            hit = self.cache.match(seq.seq_id, seq.token_ids, seq.block_keys)  # a cached prefix: computed already
            seq.num_computed = hit
            n = self._chunk(seq, budget)
            if not self.cache.grow(seq.seq_id, seq.num_computed + n):
                self.cache.release(seq.seq_id)  # gives the matched blocks back
                seq.num_computed = 0
                break
            self.cache.record_admission(seq.num_tokens, hit)
            del self.waiting[j]
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    def _waits_for_sibling(self, seq: Sequence) -> bool:
        """With prefix caching, the samples of an ``n > 1`` request after the first start once the first has
        computed the prompt: they then take its blocks (and snapshot) instead of each computing it again."""
        if seq.index == 0 or not self.cache.prefix_caching or seq.num_preemptions:
            return False
        first = self._firsts.get(seq.request_id)
        return first is not None and first.status != SeqStatus.FINISHED and first.num_computed < first.num_prompt_tokens

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of ``seq`` to compute this step: what is left, within the budget, up to the next point where
        the cache manager takes a state snapshot."""
        n = min(seq.num_tokens - seq.num_computed, budget)
        return self.cache.chunk_end(seq.num_computed, n, seq.num_prompt_tokens)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.release(seq.seq_id)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and free its cache."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.cache.release(seq.seq_id)
        seq.drop_pending()
        seq.status = SeqStatus.FINISHED
        if self._firsts.get(seq.request_id) is seq:
            del self._firsts[seq.request_id]
