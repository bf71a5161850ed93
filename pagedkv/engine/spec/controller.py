"""Adaptive k: how many tokens each sequence drafts this step, from its acceptance so far and the batch size.

A verify step of k drafted tokens yields, when each is accepted with probability a (independently, the
usual model), (1 - a^(k+1)) / (1 - a) tokens, and costs about 1 + (c * batch_size + d) * k decode steps
(c: `verify_token_cost`, the relative cost of one more token per sequence at batch 1; d: the drafter's
cost per drafted token, e.g. a draft model's size over the target's, 0 for n-gram lookup). Each sequence
drafts the k <= num_speculative_tokens with the most tokens per unit of cost; k = 0 pauses it. A
paused sequence's estimate drifts back towards the prior, so it probes again after a while; at
`max_batch_size` running sequences or more nobody drafts.
"""

from __future__ import annotations

from .config import SpeculativeConfig

PRIOR = 0.6  # acceptance assumed before a sequence has verified anything
SMOOTHING = 0.3  # weight of the newest verify step in the running estimate
DRIFT = 0.1  # per paused step, towards the prior


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verify step of k drafted tokens yields (accepted ones plus the target's own)."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


class AdaptiveK:
    def __init__(self, config: SpeculativeConfig, draft_token_cost: float = 0.0):
        self.config = config
        self.draft_token_cost = draft_token_cost
        self.acceptance: dict[int, float] = {}  # seq_id -> estimated per-token acceptance

    def num_tokens(self, seq_id: int, batch_size: int) -> int:
        cfg = self.config
        if batch_size >= cfg.max_batch_size:
            return 0
        if not cfg.adaptive:
            return cfg.num_speculative_tokens
        a = self.acceptance.get(seq_id, PRIOR)
        cost = cfg.verify_token_cost * batch_size + self.draft_token_cost
        best = max(range(cfg.num_speculative_tokens + 1), key=lambda k: (expected_tokens(a, k) / (1 + cost * k), -k))
        if best == 0:
            self.acceptance[seq_id] = a + DRIFT * (PRIOR - a)
        return best

    def record(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        if num_drafted:
            a = self.acceptance.get(seq_id, PRIOR)
            self.acceptance[seq_id] = (1 - SMOOTHING) * a + SMOOTHING * num_accepted / num_drafted

    def forget(self, seq_id: int) -> None:
        self.acceptance.pop(seq_id, None)
