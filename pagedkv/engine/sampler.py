"""Picking the next token of each sequence from its logits: greedy, temperature, top-k, top-p, seeds."""

from __future__ import annotations

import torch

from .sequence import Sequence


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside the top k and outside the top-p nucleus. logits: [vocab] float32."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[0] = False  # the most likely token always stays (a top_p under float32's range rounds to 0)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


class Sampler:
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logits: [num_seqs, vocab] (row i for seqs[i]) -> next token ids [num_seqs] int64, on logits' device.

        Launches work only (no host synchronisation), so the caller decides when to read the tokens.
        """
        tokens = logits.argmax(dim=-1)  # [num_seqs]
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.is_greedy:
                continue
            row = apply_top_k_top_p(logits[i].float() / p.temperature, p.top_k, p.top_p)
            probs = row.softmax(-1)
            if p.seed is not None and seq.generator is None:
                seq.generator = torch.Generator(device=logits.device).manual_seed(p.seed)
            tokens[i] = torch.multinomial(probs, 1, generator=seq.generator)[0]
        return tokens
