"""`Speculator`: drafts before a step, verifies after it; the engine's only door to speculative decoding.

    propose(running)       each decoding sequence gets seq.spec_token_ids (k from `AdaptiveK`), which the
                           scheduler schedules with 1 + k slots when they fit (else the draft is dropped)
    accept(seq, logits)    the verified tokens of one sequence (accepted drafts + one target token)
    forget(seq)            the sequence left the engine

Rolling back the cache and not registering unverified blocks is the engine's part: it trims the
rejected tokens and advances the sequence by the accepted ones only, before the scheduler registers
full blocks, so a block holding an unverified token is never hashed into the prefix cache.
"""

from __future__ import annotations

import torch

from ..sequence import Sequence
from .config import SpeculativeConfig
from .controller import AdaptiveK
from .draft_model import DraftModelDrafter, load_draft_model
from .drafter import Draft, Drafter
from .ngram import NgramDrafter
from .verify import verify


def make_drafter(config: SpeculativeConfig, target: torch.nn.Module, vocab_size: int) -> Drafter:
    if config.method == "ngram":
        return NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
    return DraftModelDrafter(load_draft_model(config.draft_model, target, config.draft_layers), vocab_size, target)


class Speculator:
    def __init__(self, config: SpeculativeConfig, drafter: Drafter, max_model_len: int, fixed_k: bool = False):
        """fixed_k: pad every draft to num_speculative_tokens (verify steps of one shape, for CUDA graphs)."""
        self.config = config
        self.drafter = drafter
        self.max_model_len = max_model_len
        self.fixed_k = fixed_k
        self.adaptive = AdaptiveK(config, drafter.token_cost)
        self.num_verify_steps = 0  # sequence-steps that verified at least one drafted token
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def _room(self, seq: Sequence) -> int:
        """Drafted tokens `seq` can take: a verify step emits up to k + 1 tokens, within max_tokens and the window."""
        left = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq))
        return max(0, left - 1)

    def is_active(self, batch_size: int) -> bool:
        """Whether a batch of this many running sequences drafts at all (else decode steps run as usual)."""
        return batch_size < self.config.max_batch_size

    def propose(self, running: list[Sequence]) -> None:
        for seq in running:
            seq.spec_token_ids, seq.spec_probs = [], None
        decoding = [s for s in running if s.num_uncomputed_tokens == 1]
        if not decoding:
            return
        ks = [min(self.adaptive.num_tokens(s.seq_id, len(running)), self._room(s)) for s in decoding]
        if not any(ks):
            return
        if self.fixed_k:
            ks = [min(self.config.num_speculative_tokens, self._room(s)) for s in decoding]
        drafts = self.drafter.propose(decoding, ks)
        for seq, k, draft in zip(decoding, ks, drafts):
            if self.fixed_k and len(draft) < k:
                draft = pad(draft, k, seq.token_ids[-1])
            seq.spec_token_ids, seq.spec_probs = draft.token_ids[:k], draft.probs

    def accept(self, seq: Sequence, logits: torch.Tensor, num_drafted: int) -> list[int]:
        """logits: [num_drafted + 1, vocab] of `seq`'s verify rows -> the tokens to emit."""
        draft = Draft(seq.spec_token_ids[:num_drafted], None if seq.spec_probs is None else seq.spec_probs[:num_drafted])
        tokens = verify(logits, draft, seq.params, seq.generator)
        num_accepted = len(tokens) - 1
        self.adaptive.record(seq.seq_id, num_drafted, num_accepted)
        self.num_verify_steps += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        metrics = seq.metrics
        metrics.num_spec_steps += 1
        metrics.num_draft_tokens += num_drafted
        metrics.num_accepted_tokens += num_accepted
        seq.spec_token_ids, seq.spec_probs = [], None
        return tokens

    def forget(self, seq: Sequence) -> None:
        self.adaptive.forget(seq.seq_id)
        self.drafter.release(seq)

    def stats(self) -> dict:
        steps, drafted, accepted = self.num_verify_steps, self.num_draft_tokens, self.num_accepted_tokens
        return {
            "spec_method": self.config.method,
            "spec_num_speculative_tokens": self.config.num_speculative_tokens,
            "spec_verify_steps": steps,
            "spec_draft_tokens": drafted,
            "spec_accepted_tokens": accepted,
            "spec_acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
            "spec_accepted_tokens_per_step": round(accepted / steps, 4) if steps else 0.0,
        }


def pad(draft: Draft, k: int, last_token: int) -> Draft:
    """`draft` filled up to k tokens with a deterministic guess (its last token repeated): one shape per step."""
    filler = draft.token_ids[-1] if draft.token_ids else last_token
    tokens = draft.token_ids + [filler] * (k - len(draft))
    probs = draft.probs
    if probs is not None:
        extra = torch.zeros(k - len(draft), probs.shape[-1], dtype=probs.dtype)
        extra[:, filler] = 1.0  # a deterministic token has probability 1
        probs = torch.cat([probs, extra])
    return Draft(tokens, probs)


def make_speculator(value, model: torch.nn.Module, vocab_size: int, max_model_len: int, runner) -> Speculator | None:
    """The engine's speculator from `speculative=` (None: off); on CUDA with graphs, verify steps get graphs too."""
    config = SpeculativeConfig.build(value)
    if config is None:
        return None
    fixed_k = runner.graphs is not None
    if fixed_k:
        runner.enable_verify_graphs(config.num_speculative_tokens)
    return Speculator(config, make_drafter(config, model, vocab_size), max_model_len, fixed_k=fixed_k)
