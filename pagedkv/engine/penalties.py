"""Logit penalties on the device, batched over the sequences that ask for them: presence, frequency and
repetition penalties, min_tokens and logit_bias (`SamplingParams`).

Each such sequence keeps its state on the logits' device: how often each token occurs in its output
(`counts`, [vocab] float32, bumped from the sampled token ids on the device) and which tokens its prompt
holds (`prompt_mask`, [vocab] bool). A step reads nothing back to the host, so a decode step queued behind
one still in flight (CUDA graphs) sees the penalties of the token it has not read yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PenaltyState:
    counts: torch.Tensor  # [vocab] float32: occurrences of each token in the output so far
    prompt_mask: torch.Tensor  # [vocab] bool: tokens of the prompt
    num_sampled: int = 0  # tokens sampled so far (min_tokens)

    def clone(self) -> "PenaltyState":
        return PenaltyState(self.counts.clone(), self.prompt_mask, self.num_sampled)


def _state(seq, vocab_size: int, device: torch.device) -> PenaltyState:
    if seq.penalties is None:
        prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        prompt_mask[torch.tensor(seq.prompt_token_ids, device=device)] = True
        counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        for t in seq.output_token_ids:  # a sequence that started before it had a state (none today)
            counts[t] += 1
        seq.penalties = PenaltyState(counts, prompt_mask, seq.num_output_tokens)
    return seq.penalties


def apply_penalties(logits: torch.Tensor, seqs: list, stop_token_ids: set[int]) -> torch.Tensor:
    """logits: [num_seqs, vocab] (row i for seqs[i]) -> the same with each asking row penalised (a new tensor;
    `logits` is left as it is, for log-probabilities). `stop_token_ids`: what min_tokens masks besides each
    sequence's own stop_token_ids (the end-of-sequence ids; none for a sequence that ignores EOS)."""
    rows = [i for i, s in enumerate(seqs) if s.params.has_penalties]
    if not rows:
        return logits
    vocab, device = logits.shape[-1], logits.device
    states = [_state(seqs[i], vocab, device) for i in rows]
    params = [seqs[i].params for i in rows]
    index = torch.tensor(rows, device=device)
    x = logits.index_select(0, index).float()  # [k, vocab]
    counts = torch.stack([st.counts for st in states])  # [k, vocab]
    seen = counts > 0

    def column(name: str) -> torch.Tensor:  # [k, 1] float32
        return torch.tensor([[float(getattr(p, name))] for p in params], device=device)

    rep = column("repetition_penalty")
    repeated = seen | torch.stack([st.prompt_mask for st in states])
    x = torch.where(repeated, torch.where(x > 0, x / rep, x * rep), x)
    x = x - column("frequency_penalty") * counts - column("presence_penalty") * seen.float()
    big = torch.finfo(logits.dtype).max   # a tiny penalty (5e-324 is in range) must not make a logit infinite
    x = x.clamp(-big, big)
    for j, (p, st) in enumerate(zip(params, states)):
        if p.logit_bias:
            ids, bias = zip(*p.logit_bias)
            x[j, torch.tensor(ids, device=device)] += torch.tensor(bias, device=device)
        if st.num_sampled < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else stop_token_ids)
            if stops:
                x[j, torch.tensor(sorted(stops), device=device)] = float("-inf")
    return logits.index_copy(0, index, x.to(logits.dtype))


def record_tokens(tokens: torch.Tensor, seqs: list) -> None:
    """tokens: [num_seqs] int64 on the device, just sampled for seqs: count them (no host synchronisation)."""
    for i, seq in enumerate(seqs):
        if seq.penalties is not None:
            seq.penalties.counts.index_add_(0, tokens[i:i + 1], torch.ones(1, device=tokens.device))
            seq.penalties.num_sampled += 1
