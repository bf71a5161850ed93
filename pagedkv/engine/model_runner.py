"""The model runner: one packed forward pass over a scheduled batch, returning the logits to sample.

The batch's new tokens are packed into one row (`input_ids`, `position_ids`: [1, num_tokens]); the cache
plans the step (`begin_step`: slots, block tables, `query_start_loc`), so one forward mixes prefill
chunks and decodes. Only the rows of sequences that reach their last token produce logits. On CUDA,
pure decode batches replay a captured CUDA graph instead of running the model in Python.
"""

from __future__ import annotations

import warnings

import torch

from ..cache import PagedKVCache
from ..errors import CacheCapacityError
from ..hf import cache_kwarg
from .config import EngineConfig
from .cuda_graph import CUDAGraphRunner
from .scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, config: EngineConfig, max_model_len: int):
        self.model = model
        self.cache = cache
        self.cache_kwarg = cache_kwarg(model)
        self.device = next(model.parameters()).device
        self.graphs = None
        if self.device.type == "cuda" and not config.enforce_eager:
            self.graphs = CUDAGraphRunner(model, cache, self.cache_kwarg, config.graph_batch_sizes,
                                          max_blocks_per_seq=cache.blocks_for(max_model_len))

    def disable_graphs(self, exc: Exception) -> None:
        warnings.warn(f"pagedkv: CUDA graphs are off for this engine, decoding eagerly ({type(exc).__name__}: {exc})",
                      RuntimeWarning, stacklevel=3)
        self.graphs = None

    def can_replay(self, batch: ScheduledBatch) -> bool:
        return self.graphs is not None and batch.is_decode and self.graphs.can_run(len(batch.seqs))

    @torch.inference_mode()
    def run_ahead(self, seqs: list, input_ids: torch.Tensor) -> torch.Tensor:
        """A decode step queued behind one still in flight: `input_ids` [len(seqs)] are that step's sampled
        tokens, on the device; returns logits [len(seqs), vocab]. Raises CacheCapacityError (cache untouched)."""
        return self.graphs.run(seqs, input_ids=input_ids)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int], bool]:
        """Forward `batch`; returns (logits [num_sampled, vocab], index in batch.seqs of each logits row,
        whether a CUDA graph was replayed).

        Raises CacheCapacityError (cache untouched) when the new tokens' blocks do not fit.
        """
        seqs, counts = batch.seqs, batch.num_new_tokens
        sample_idx = [i for i, (s, n) in enumerate(zip(seqs, counts)) if s.num_computed_tokens + n == len(s)]
        if self.can_replay(batch):
            try:
                return self.graphs.run(seqs), sample_idx, True
            except CacheCapacityError:
                raise
            except Exception as exc:  # a model or kernel that cannot be captured: stay correct, run eagerly
                self.disable_graphs(exc)
        input_ids, positions, last_rows = [], [], []
        for s, n in zip(seqs, counts):
            start = s.num_computed_tokens
            input_ids.extend(s.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            last_rows.append(len(input_ids) - 1)
        keep = [last_rows[i] for i in sample_idx] or [len(input_ids) - 1]
        self.cache.begin_step([s.seq_id for s in seqs], counts, device=self.device)
        try:
            out = self.model(input_ids=torch.tensor([input_ids], device=self.device),  # [1, num_tokens]
                             position_ids=torch.tensor([positions], device=self.device),
                             logits_to_keep=torch.tensor(keep, device=self.device), use_cache=True,
                             **{self.cache_kwarg: self.cache})
        finally:
            self.cache.end_forward()
        logits = out.logits[0]  # [len(keep), vocab]
        return (logits if sample_idx else logits[:0]), sample_idx, False
