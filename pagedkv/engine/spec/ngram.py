"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of the last n tokens."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..sequence import Sequence
from .drafter import Draft, Drafter


def lookup(token_ids: list[int] | np.ndarray, num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_tokens` tokens that followed the latest earlier match of the last n tokens (n = max_n .. min_n)."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = tokens[length - n:]
        windows = sliding_window_view(tokens[:length - 1], n)  # windows[i] = tokens[i:i + n], ends before the last
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + num_tokens].tolist()
    return []


class NgramDrafter(Drafter):
    """Prompt lookup over each sequence's prompt and output; deterministic drafts (probability 1)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft]:
        return [Draft(lookup(s.token_ids, k, self.min_n, self.max_n) if k else []) for s, k in zip(seqs, num_tokens)]
