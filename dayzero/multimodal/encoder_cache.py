"""The encoder cache: each image's vision features by content hash, so the same image is encoded once.

An entry is *held* by every sequence that still has placeholder tokens of that image to compute (a chunked
prefill may cut through an image: its later rows come from the entry in later steps); an entry nobody holds
stays in least-recently-used order for later requests with the same image, and is evicted once the unheld
entries exceed ``capacity_tokens`` feature rows. Held entries are never evicted, whatever their size.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch


@dataclass
class Entry:
    features: torch.Tensor  # [M, D] on the device
    deepstack: list[torch.Tensor]  # each [M, D]
    holders: set[int] = field(default_factory=set)  # sequence ids


class EncoderCache:
    def __init__(self, capacity_tokens: int):
        self.capacity = capacity_tokens
        self.entries: dict[bytes, Entry] = {}
        self.unheld: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self.unheld_tokens = 0
        self.num_encoded = 0  # images the tower encoded
        self.num_hits = 0  # images a sequence took from the cache instead

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def holds(self, seq_id: int, key: bytes) -> bool:
        e = self.entries.get(key)
        return e is not None and seq_id in e.holders

    def put(self, key: bytes, features: torch.Tensor, deepstack: list[torch.Tensor], holders) -> None:
        """A freshly encoded image, held by the sequences ``holders`` it was encoded for: one encode, and a hit for
        every holder past the first (the same image in several requests of one step)."""
        self.entries[key] = Entry(features, deepstack, set(holders))
        self.num_encoded += 1
        self.num_hits += max(len(holders) - 1, 0)
        if not holders:
            self._unhold(key)

    def take(self, seq_id: int, key: bytes) -> Entry:
        """Sequence ``seq_id`` holds the entry from now on (a cache hit, unless it held it already)."""
        e = self.entries[key]
        if seq_id not in e.holders:
            self.num_hits += 1
            if not e.holders:
                self.unheld.pop(key, None)
                self.unheld_tokens -= e.features.shape[0]
            e.holders.add(seq_id)
        return e

    def drop(self, seq_id: int, key: bytes) -> None:
        """``seq_id`` needs the entry no more (its tokens are computed, or the sequence ended)."""
        e = self.entries.get(key)
        if e is None or seq_id not in e.holders:
            return
        e.holders.discard(seq_id)
        if not e.holders:
            self._unhold(key)

    def _unhold(self, key: bytes) -> None:
        self.unheld[key] = None
        self.unheld_tokens += self.entries[key].features.shape[0]
        while self.unheld_tokens > self.capacity and self.unheld:
            old, _ = self.unheld.popitem(last=False)
            self.unheld_tokens -= self.entries.pop(old).features.shape[0]
