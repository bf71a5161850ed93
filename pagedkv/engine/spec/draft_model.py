"""A draft model: a smaller causal LM with the target's tokenizer, over its own paged cache.

Per sequence the draft cache holds the keys/values of the tokens the drafter last saw; a proposal first
rolls it back to the longest prefix it shares with the sequence's verified tokens (rejected drafts go),
feeds the rest, then drafts k tokens with k - 1 more forward passes, every drafting sequence packed
into one forward per position. Greedy requests take the draft's argmax; sampling requests sample from
the draft's distribution under their own temperature / top-k / top-p, which rejection sampling needs.
"""

from __future__ import annotations

import torch

from ...errors import ConfigError
from ...hf import cache_kwarg, install_paged_kv_cache, text_config
from ..sequence import Sequence
from .drafter import Draft, Drafter
from .verify import target_probs


def first_layers(model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """`model` cut to its first `num_layers` decoder layers (embeddings, final norm and head shared, no copy)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ConfigError(f"draft_layers needs a decoder with a `model.layers` list; {type(model).__name__} has none: "
                          "leave draft_layers unset and give a smaller draft model")
    if num_layers > len(layers):
        raise ConfigError(f"draft_layers={num_layers} but the draft model has only {len(layers)} layers")
    config = model.config.__class__.from_dict({**model.config.to_dict(), "num_hidden_layers": num_layers})
    config._attn_implementation = model.config._attn_implementation
    with torch.device("meta"):
        draft = type(model)(config)
    for name, child in inner.named_children():
        setattr(draft.model, name, layers[:num_layers] if name == "layers" else child)
    for name, child in model.named_children():
        if name != "model":
            setattr(draft, name, child)
    draft.generation_config = model.generation_config
    return draft.eval()


def load_draft_model(spec, target: torch.nn.Module, num_layers: int | None) -> torch.nn.Module:
    """The draft model from a loaded module or a path ("default", a folder, a .gguf), on the target's device."""
    if isinstance(spec, torch.nn.Module):
        model = spec
    else:
        from ...models import load_model

        param = next(target.parameters())
        model, _ = load_model(str(spec), dtype=param.dtype, device=str(param.device))
    return first_layers(model, num_layers) if num_layers else model


class DraftModelDrafter(Drafter):
    def __init__(self, model: torch.nn.Module, vocab_size: int, target: torch.nn.Module | None = None):
        self.model = model
        if target is not None:  # a forward pass costs about its share of the target's parameters
            self.token_cost = sum(p.numel() for p in model.parameters()) / sum(p.numel() for p in target.parameters())
        self.vocab_size = vocab_size  # the target's: draft rows are cut or padded to it
        self.cache = install_paged_kv_cache(model, dynamic=True, num_blocks=64)
        self.cache_kwarg = cache_kwarg(model)
        self.device = next(model.parameters()).device
        self.fed: dict[int, list[int]] = {}  # seq_id -> tokens whose keys/values the draft cache holds
        draft_vocab = text_config(model.config).vocab_size
        if abs(draft_vocab - vocab_size) > 1024:
            raise ConfigError(f"the draft model's vocabulary ({draft_vocab} tokens) is not the target's ({vocab_size}): "
                              "a draft model must use the same tokenizer")

    def release(self, seq: Sequence) -> None:
        if self.fed.pop(seq.seq_id, None) is not None:
            self.cache.free(seq.seq_id)

    def _rollback(self, seq: Sequence) -> list[int]:
        """Trim the draft cache to the prefix it shares with seq.token_ids[:-1]; returns the tokens to feed."""
        tokens = seq.token_ids
        fed = self.fed.get(seq.seq_id)
        if fed is None:
            self.cache.add_sequence(seq.seq_id)
            fed = self.fed[seq.seq_id] = []
        common = 0
        limit = min(len(fed), len(tokens) - 1)
        while common < limit and fed[common] == tokens[common]:
            common += 1
        self.cache.trim(len(fed) - common, seq.seq_id)
        del fed[common:]
        return tokens[common:]

    @torch.inference_mode()
    def _forward(self, seq_ids: list[int], chunks: list[list[int]]) -> torch.Tensor:
        """Feed chunks[i] to sequence seq_ids[i]; returns the logits after each chunk, [len(chunks), vocab]."""
        input_ids, positions, keep = [], [], []
        for sid, chunk in zip(seq_ids, chunks):
            start = len(self.fed[sid])
            input_ids.extend(chunk)
            positions.extend(range(start, start + len(chunk)))
            keep.append(len(input_ids) - 1)
            self.fed[sid].extend(chunk)
        self.cache.begin_step(seq_ids, [len(c) for c in chunks], device=self.device)
        try:
            out = self.model(input_ids=torch.tensor([input_ids], device=self.device),  # [1, num_tokens]
                             position_ids=torch.tensor([positions], device=self.device),
                             logits_to_keep=torch.tensor(keep, device=self.device), use_cache=True,
                             **{self.cache_kwarg: self.cache})
        finally:
            self.cache.end_forward()
        logits = out.logits[0].float()  # [len(chunks), draft vocab]
        v = self.vocab_size
        if logits.shape[-1] < v:
            logits = torch.cat([logits, logits.new_full((logits.shape[0], v - logits.shape[-1]), float("-inf"))], 1)
        return logits[:, :v]

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft]:
        active = [i for i, k in enumerate(num_tokens) if k > 0]
        tokens: dict[int, list[int]] = {i: [] for i in active}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        chunks = {i: self._rollback(seqs[i]) for i in active}
        while active:
            logits = self._forward([seqs[i].seq_id for i in active], [chunks[i] for i in active])
            for row, i in enumerate(active):
                seq = seqs[i]
                if seq.params.is_greedy:
                    token = int(logits[row].argmax())
                else:
                    q = target_probs(logits[row:row + 1], seq.params)[0]
                    token = int(torch.multinomial(q, 1, generator=seq.generator))
                    probs[i].append(q)
                tokens[i].append(token)
                chunks[i] = [token]
            active = [i for i in active if len(tokens[i]) < num_tokens[i]]
        return [Draft(tokens.get(i, []), torch.stack(probs[i]).cpu() if probs.get(i) else None)
                for i in range(len(seqs))]
