"""The drafter interface: propose up to k next tokens per sequence; the target model verifies them.

A drafter sees the engine's sequences (their `token_ids`: prompt and verified output) and nothing of the
scheduler or the pages. A draft model keeps its own state per sequence and is told when a sequence
leaves (`release`). A third kind (a model's own multi-token-prediction heads) fits the same two calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..sequence import Sequence


@dataclass
class Draft:
    """Proposed tokens for one sequence.

    token_ids: up to k proposed tokens; probs: [len(token_ids), vocab] float32, the drafter's distribution
    at each proposed position (the token was sampled from it), or None when the proposal is deterministic
    (an n-gram, or a greedy draft): exact rejection sampling then counts each token as probability 1.
    """

    token_ids: list[int]
    probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.token_ids)


class Drafter(ABC):
    """Base class: `propose` is required, `release` optional.

    token_cost: the cost of drafting one token relative to a decode step of the target (adaptive k
    weighs it against the acceptance).
    """

    token_cost: float = 0.0

    @abstractmethod
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft]:
        """Up to num_tokens[i] tokens to follow seqs[i].token_ids (fewer, or none, when it has no guess)."""

    def release(self, seq: Sequence) -> None:
        """`seq` finished or was preempted: drop whatever state the drafter keeps for it."""
