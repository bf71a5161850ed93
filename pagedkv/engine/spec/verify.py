"""Verification of drafted tokens against the target model's logits: greedy and exact rejection sampling.

Rejection sampling (Leviathan et al. 2023, Chen et al. 2023): drafted token x with drafter probability
q(x) is kept with probability min(1, p(x) / q(x)) under the target's p; the first rejected position is
resampled from the residual max(0, p - q), renormalised; if every token is kept, one more is sampled
from p at the position after them. Whatever q is, each emitted token then follows p exactly. A
deterministic draft (n-gram, greedy drafter) has q = 1 on its token: kept with probability p(x), and the
residual is p without x.
"""

from __future__ import annotations

import torch

from ..sampler import apply_top_k_top_p
from ..sampling_params import SamplingParams
from .drafter import Draft


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [n, vocab] -> the sampling distribution of each row [n, vocab] float32 (temperature, top-k, top-p)."""
    rows = [apply_top_k_top_p(row.float() / params.temperature, params.top_k, params.top_p) for row in logits]
    return torch.stack(rows).softmax(-1)


def acceptance_probability(p_x: float, q_x: float) -> float:
    """The probability of keeping a drafted token that the target gives p_x and the drafter gave q_x."""
    return min(1.0, p_x / q_x)


def residual(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """The distribution to resample a rejected position from: max(0, p - q) renormalised ([vocab] float32)."""
    if q is None:
        r = p.clone()
        r[token] = 0.0
    else:
        r = (p - q).clamp_min(0.0)
    total = r.sum()
    return r / total if total > 0 else p


def verify(logits: torch.Tensor, draft: Draft, params: SamplingParams, generator: torch.Generator | None) -> list[int]:
    """The tokens to emit after a verify step: the accepted prefix of the draft, then one target token.

    logits: [len(draft) + 1, vocab], row j the target's prediction after the context and draft[:j].
    """
    n = len(draft)
    if params.is_greedy:
        target = logits.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < n and draft.token_ids[accepted] == target[accepted]:
            accepted += 1
        return draft.token_ids[:accepted] + [target[accepted]]
    p = target_probs(logits, params)  # [n + 1, vocab]
    device = p.device
    uniforms = torch.rand(n, generator=generator, device=device).tolist() if n else []
    p_drafted = p[torch.arange(n, device=device), torch.tensor(draft.token_ids, device=device)].tolist() if n else []
    q_drafted = (draft.probs[torch.arange(n), torch.tensor(draft.token_ids)].tolist()
                 if draft.probs is not None else [1.0] * n)
    for j, token in enumerate(draft.token_ids):
        if uniforms[j] >= acceptance_probability(p_drafted[j], q_drafted[j]):
            q = draft.probs[j].to(device) if draft.probs is not None else None
            fixed = torch.multinomial(residual(p[j], q, token), 1, generator=generator).item()
            return draft.token_ids[:j] + [fixed]
    return draft.token_ids + [torch.multinomial(p[n], 1, generator=generator).item()]
