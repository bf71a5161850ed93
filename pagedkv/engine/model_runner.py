"""The model runner: one packed forward pass over a scheduled batch, returning the logits to sample.

The batch's new tokens are packed into one row (`input_ids`, `position_ids`: [1, num_tokens]); the cache
plans the step (`begin_step`: slots, block tables, `query_start_loc`), so one forward mixes prefill
chunks and decodes. Only the rows of sequences that reach their last token produce logits. On CUDA,
pure decode batches replay a captured CUDA graph instead of running the model in Python, and with
`EngineConfig.cuda_graph_mixed_tokens` so do steps of decodes and then small prefill chunks (`MixedGraphRunner`).
"""

from __future__ import annotations

import sys
import warnings

import numpy as np
import torch

from ..cache import PagedKVCache
from ..errors import CacheCapacityError
from ..hf import cache_kwarg
from .config import EngineConfig
from .cuda_graph import CUDAGraphRunner, MixedGraphRunner
from .scheduler import ScheduledBatch


_compile_announced = False

# a sequence's last token while the step that samples it is still in flight (`LLMEngine._queue_after`): its input
# row is filled on the device, never embedded as such
PLACEHOLDER = -1


def announce_compile(num_layers: int) -> None:
    """Say on stderr, once per process, that the decoder layers compile on their first steps."""
    global _compile_announced
    if not _compile_announced:
        _compile_announced = True
        print(f"pagedkv: the {num_layers} decoder layers run under torch.compile: the first steps of each new shape "
              "compile (seconds; kept in torch's cache for the next process). compile_layers=False or "
              "--no-compile-layers turns it off", file=sys.stderr, flush=True)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, config: EngineConfig, max_model_len: int):
        self.model = model
        self.cache = cache
        self.cache_kwarg = cache_kwarg(model)
        self.device = next(model.parameters()).device
        self.graphs = self.verify_graphs = self.mixed_graphs = None
        tensor_parallel = hasattr(cache, "peers")   # a sharded cache
        if config.compiles_layers(self.device, tensor_parallel=tensor_parallel):
            from ..hf import compile_layers

            n = compile_layers(model)
            announce_compile(n)
        if self.device.type == "cuda" and not config.enforce_eager:
            self.graphs = CUDAGraphRunner(model, cache, self.cache_kwarg, config.graph_batch_sizes,
                                          max_blocks_per_seq=cache.blocks_for(max_model_len))
            if config.cuda_graph_mixed_tokens and not tensor_parallel:
                self.mixed_graphs = MixedGraphRunner(model, cache, self.cache_kwarg, config.graph_batch_sizes,
                                                     max_blocks_per_seq=cache.blocks_for(max_model_len),
                                                     step_tokens=config.cuda_graph_mixed_tokens)

    def disable_graphs(self, exc: Exception) -> None:
        warnings.warn(f"pagedkv: CUDA graphs are off for this engine, decoding eagerly ({type(exc).__name__}: {exc})",
                      RuntimeWarning, stacklevel=3)
        self.graphs = self.verify_graphs = self.mixed_graphs = None

    def enable_verify_graphs(self, num_speculative_tokens: int) -> None:
        """Verify steps of exactly 1 + k tokens per sequence replay CUDA graphs too (when decode steps do)."""
        if self.graphs is not None:
            g = self.graphs
            self.verify_graphs = CUDAGraphRunner(self.model, self.cache, self.cache_kwarg, tuple(g.batch_sizes),
                                                 max_blocks_per_seq=g.max_blocks, query_len=1 + num_speculative_tokens)

    def rolled_back(self, seq_id: int, num_blocks: int) -> None:
        """A rollback left cache sequence `seq_id` with `num_blocks` blocks (the graph runners' tables catch up)."""
        for graphs in (self.graphs, self.verify_graphs, self.mixed_graphs):
            if graphs is not None:
                graphs.rolled_back(seq_id, num_blocks)

    def can_replay(self, batch: ScheduledBatch) -> bool:
        return self.graphs is not None and batch.is_decode and self.graphs.can_run(len(batch.seqs))

    def mixed_decodes(self, batch: ScheduledBatch) -> int | None:
        """How many decodes lead a step that a mixed CUDA graph replays (decodes, then prefill chunks that fit its
        layout; no drafts, no prompt log-probabilities), else None."""
        graphs = self.mixed_graphs
        if graphs is None or batch.is_verify:
            return None
        seqs, counts = batch.seqs, batch.num_new_tokens
        n = 0
        while n < len(seqs) and counts[n] == 1 and seqs[n].num_computed_tokens > 0:
            n += 1
        if n == len(seqs) or any(s.params.prompt_logprobs is not None for s in seqs[n:]):
            return None
        return n if graphs.can_run_mixed(n, counts[n:]) else None

    def can_replay_verify(self, batch: ScheduledBatch) -> bool:
        """Every sequence decodes with exactly the verify graphs' k drafted tokens."""
        graphs = self.verify_graphs
        return (graphs is not None and batch.is_verify and graphs.can_run(len(batch.seqs))
                and all(m == graphs.query_len - 1 and n == graphs.query_len and s.num_computed_tokens > 0
                        for s, n, m in zip(batch.seqs, batch.num_new_tokens, batch.num_spec_tokens)))

    @torch.inference_mode()
    def run_ahead(self, seqs: list, input_ids: torch.Tensor) -> torch.Tensor:
        """A decode step queued behind one still in flight: `input_ids` [len(seqs)] are that step's sampled
        tokens, on the device; returns logits [len(seqs), vocab]. Raises CacheCapacityError (cache untouched)."""
        return self.graphs.run(seqs, input_ids=input_ids)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, pending: tuple[torch.Tensor, dict[int, int]] | None = None
            ) -> tuple[torch.Tensor, list[int], bool, dict[int, torch.Tensor]]:
        """Forward `batch`; returns (logits, index in batch.seqs of each sampled sequence, whether a decode CUDA graph
        was replayed (the engine may queue the next decode step behind it), prompt logits).

        `pending`: (tokens, {id(seq): i}) when the step before is still in flight: a sequence in the map has
        PLACEHOLDER as its last token, whose value is tokens[i] on the device (that step's sampled tokens, not
        read yet); its input row is filled from there on the device.

        logits: [num_rows, vocab], one row per sampled sequence, in order; a sequence verifying m drafted
        tokens (batch.num_spec_tokens) gets its m + 1 rows (the predictions after its last token and after
        each drafted one). prompt logits: index in batch.seqs -> [rows, vocab], for a sequence that wants its
        prompt's log-probabilities, the predictions of its prompt tokens after the chunk's first (each row
        predicts the token after its position). Raises CacheCapacityError (cache untouched) when the new
        tokens' blocks do not fit.
        """
        seqs, counts = batch.seqs, batch.num_new_tokens
        spec = batch.num_spec_tokens or [0] * len(seqs)
        sample_idx = [i for i, (s, n, m) in enumerate(zip(seqs, counts, spec)) if s.num_computed_tokens + n - m == len(s)]
        if self.can_replay(batch):
            try:
                if pending is None:
                    return self.graphs.run(seqs), sample_idx, True, {}
                ids = [s.token_ids[-1] for s in seqs]
                fills = [(i, pending[1][id(s)]) for i, s in enumerate(seqs) if id(s) in pending[1]]
                return self.graphs.run(seqs, input_ids=self._filled_ids(ids, fills, pending[0])), sample_idx, True, {}
            except CacheCapacityError:
                raise
            except Exception as exc:  # a model or kernel that cannot be captured: stay correct, run eagerly
                self.disable_graphs(exc)
        n = self.mixed_decodes(batch)
        if n is not None:
            try:
                sampled = set(sample_idx)
                logits = self.mixed_graphs.run_mixed(seqs, counts, n, [i in sampled for i in range(n, len(seqs))],
                                                     pending)
                return logits, sample_idx, False, {}   # the engine goes on as after an eager step
            except CacheCapacityError:
                raise
            except Exception as exc:
                self.disable_graphs(exc)
        if self.can_replay_verify(batch):
            try:
                return self.verify_graphs.run(seqs, [[s.token_ids[-1], *s.spec_token_ids[:m]] for s, m in zip(seqs, spec)]), \
                    sample_idx, False, {}
            except CacheCapacityError:
                raise
            except Exception as exc:
                self.disable_graphs(exc)
        input_ids, positions, rows, prompt_rows, fills = [], [], [], {}, []
        for i, (s, n, m) in enumerate(zip(seqs, counts, spec)):
            start = s.num_computed_tokens
            if s.params.prompt_logprobs is not None and start + 1 < s.num_prompt_tokens:
                # positions start .. before the last prompt token predict prompt tokens start + 1 ..
                prompt_rows[i] = range(len(input_ids), len(input_ids) + min(n, s.num_prompt_tokens - 1 - start))
            if pending is not None and id(s) in pending[1] and start <= len(s.token_ids) - 1 < start + n - m:
                fills.append((len(input_ids) + len(s.token_ids) - 1 - start, pending[1][id(s)]))
            input_ids.extend(s.token_ids[start:start + n - m])
            input_ids.extend(s.spec_token_ids[:m])
            positions.extend(range(start, start + n))
            rows.append(range(len(input_ids) - 1 - m, len(input_ids)))
        keep = [r for i in sample_idx for r in rows[i]] or [len(input_ids) - 1]
        num_sample_rows = len(keep)
        keep += [r for i in prompt_rows for r in prompt_rows[i]]
        meta = self.cache.begin_step([s.seq_id for s in seqs], counts, device=self.device)
        meta.phase_hint = "verify" if any(spec) else None
        try:
            ids = self._filled_ids(input_ids, fills, pending[0]) if fills else self._ids(input_ids)
            out = self.model(input_ids=ids[None],  # [1, num_tokens]
                             position_ids=self._ids(positions)[None],
                             logits_to_keep=self._ids(keep), use_cache=True,
                             **{self.cache_kwarg: self.cache})
        finally:
            self.cache.end_forward()
        logits = out.logits[0]  # [len(keep), vocab]
        prompt_logits, row = {}, num_sample_rows
        for i, r in prompt_rows.items():
            prompt_logits[i] = logits[row:row + len(r)]
            row += len(r)
        logits = logits[:num_sample_rows]
        return (logits if sample_idx else logits[:0]), sample_idx, False, prompt_logits

    def _filled_ids(self, values: list[int], fills: list[tuple[int, int]], tokens: torch.Tensor) -> torch.Tensor:
        """`_ids(values)` with values[row] = tokens[i] for each (row, i) of `fills`, filled on the device (`tokens`:
        the sampled tokens of a step still in flight)."""
        ids = self._ids(values)
        if not fills:
            return ids
        rows, src = zip(*fills)
        ids[self._ids(list(rows))] = tokens[torch.tensor(src, dtype=torch.int64).to(tokens.device)].to(ids.device)
        return ids

    def _ids(self, values: list[int]) -> torch.Tensor:
        """An int64 tensor on the model's device from a list of ints: through numpy, which converts a long list (a
        prefill step's 16,384 token ids) ten times faster than `torch.tensor` does."""
        return torch.from_numpy(np.array(values, dtype=np.int64)).to(self.device)
