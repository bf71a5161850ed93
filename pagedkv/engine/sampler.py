"""Picking the next token of each sequence from its logits: greedy, temperature, top-k, top-p, seeds."""

from __future__ import annotations

import torch

from .outputs import TokenLogprob
from .penalties import apply_penalties, record_tokens
from .sequence import Sequence


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> list[TokenLogprob]:
    """logits: [rows, vocab] raw model logits; token_ids: [rows] int64 -> each row's log-probability of its token
    and its `num_top` most likely tokens (log-softmax in float32, before temperature and truncation)."""
    logprobs = logits.float().log_softmax(-1)  # [rows, vocab]
    chosen = logprobs.gather(1, token_ids.view(-1, 1).to(logprobs.device))[:, 0].tolist()
    top_lp, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (logprobs[:, :0], logprobs[:, :0].long())
    return [TokenLogprob(t, lp, list(zip(ids, lps)))
            for t, lp, ids, lps in zip(token_ids.tolist(), chosen, top_ids.tolist(), top_lp.tolist())]


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
    def __init__(self, eos_token_ids: set[int] | None = None):
        self.eos_token_ids = set(eos_token_ids or ())  # what min_tokens holds back

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logits: [num_seqs, vocab] (row i for seqs[i]) -> next token ids [num_seqs] int64, on logits' device.

        Penalties (SamplingParams) apply first. Launches work only (no host synchronisation), so the caller
        decides when to read the tokens.
        """
        logits = apply_penalties(logits, seqs, self.eos_token_ids)
        tokens = logits.argmax(dim=-1)  # [num_seqs]
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.is_greedy:
                continue
            # a tiny temperature may overflow a logit: the largest finite value keeps the softmax defined
            scaled = (logits[i].float() / p.temperature).clamp(max=torch.finfo(torch.float32).max)
            row = apply_top_k_top_p(scaled, p.top_k, p.top_p)
            probs = row.softmax(-1)
            if p.seed is not None and seq.generator is None:
                seq.generator = torch.Generator(device=logits.device).manual_seed(p.seed)
            tokens[i] = torch.multinomial(probs, 1, generator=seq.generator)[0]
        record_tokens(tokens, seqs)
        return tokens
