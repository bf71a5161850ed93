"""Per-step page-table metadata, planned once per forward and shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Whether planners (`PagedKVCache.begin_step`, the CUDA graph runner) give steps of equally many new tokens per
# sequence a `token_order`, longest attention span first, in which the GPU decode kernels then launch their programs
# (`decode_io.launch_grid`): an engine's batch holds sequences of different lengths, and programs launched in
# grid order end with the longest ones still running on a GPU otherwise idle (H200, same-memory engine run: TurboQuant
# +2.7% at equal lengths, +5.3% with lengths spread +-50%, q4 +2.6% there; BENCHMARKS.md, 2026-12-05).
LONGEST_FIRST = True


def longest_first(seq_lens, tokens_per_seq: int) -> np.ndarray | None:
    """The packed query tokens of a step with `tokens_per_seq` new tokens for every sequence, ordered from the
    longest attention span to the shortest (a sequence's later tokens first), as int32; None for other steps."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    if tokens_per_seq < 1 or lens.size == 0:
        return None
    seqs = np.argsort(-lens, kind="stable")
    return (seqs[:, None] * tokens_per_seq + np.arange(tokens_per_seq - 1, -1, -1)).reshape(-1).astype(np.int32)


def launch_order(seq_lens, num_new_tokens, device) -> torch.Tensor | None:
    """The token order a step's GPU decode kernels launch in (`AttentionMetadata.token_order`), or None for grid
    order: with `LONGEST_FIRST`, on CUDA, for steps of equally many new tokens per sequence, as many as the decode
    kernels read at most (decode and verify steps, and the decodes of a mixed step; not prefill chunks). Every
    decode launch of an engine then compiles and runs the same (ordered) kernel variants."""
    if not (LONGEST_FIRST and torch.device(device).type == "cuda" and num_new_tokens
            and len(set(num_new_tokens)) == 1):
        return None
    from .triton.tuning import WINDOW_MAX_NEW_TOKENS

    if num_new_tokens[0] > WINDOW_MAX_NEW_TOKENS:
        return None
    return torch.from_numpy(longest_first(seq_lens, num_new_tokens[0])).to(device, non_blocking=True)


@dataclass
class WindowPlan:
    """A step's dense recent window (`recent_tokens`, `pagedkv.window`): where new tokens' exact keys/values
    go and which blocks each sequence reads from its ring.

    token_index:     [num_kept] int64, the packed new tokens kept in the rings (a step's last R blocks)
    slot_mapping:    [num_kept] int64, their slots in a layer's ring tensor viewed as
                     [num_rows * num_ring_blocks * block_size, H, D]
    rows:            [num_seqs] int32, ring row of each sequence
    first_block:     [num_seqs] int32, first block of each sequence read from its ring (logical block b in
                     ring slot b % num_ring_blocks); blocks before it, and all when it is past the last
                     block, come from the pages
    rows_cpu, first_block_cpu: host copies of `rows` and `first_block`
    """

    token_index: torch.Tensor
    slot_mapping: torch.Tensor
    rows: torch.Tensor
    first_block: torch.Tensor
    rows_cpu: list[int]
    first_block_cpu: list[int]
    num_ring_blocks: int


@dataclass
class AttentionMetadata:
    """Where this step's tokens go and what each sequence attends over.

    block_table:     [num_seqs, max_blocks] int32, block ids per sequence (row b of every layer's pages)
    seq_lens:        [num_seqs] int32, tokens per sequence after this step's writes
    query_start_loc: [num_seqs + 1] int32, offsets of each sequence's new tokens in the packed queries
    slot_mapping:    [num_input_tokens] int64, page slot of every input position (-1: padding, not stored)
    token_index:     [num_tokens] int64 positions of the real tokens among the input positions, or None
                     when there is no padding (input positions and packed tokens coincide)
    seq_ids:         the cache's sequence id of each row, or None (metadata built outside the cache)
    phase_hint:      the phase its planner knows the step to be (an engine's "verify" step), else None
    window:          the dense recent window's plan, or None (no window)
    token_order:     [num_tokens] int32, the query tokens longest attention span first (`LONGEST_FIRST`), or None
    parts:           (decodes, chunks) for a step laid out for a CUDA graph of decodes and prefill chunks
                     (`engine.cuda_graph`, mixed steps): the metadata of its first rows, one new token per sequence
                     (the decode kernels), and of the rest, prefill chunks (the fused varlen kernel over the pages,
                     which sizes its launch from shapes alone and skips query rows past the last chunk), so that one
                     capture serves any chunk lengths and contexts; else None. The GPU kernels attend in these two
                     launches; the whole (which the cache writes through) stays a plain batch for the other paths.
    The `*_cpu` lists are host copies, so no kernel launch needs a device sync to size itself.
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    token_index: torch.Tensor | None
    seq_lens_cpu: list[int]
    query_start_loc_cpu: list[int]
    block_size: int
    seq_ids: list[int] | None = None
    phase_hint: str | None = None
    window: WindowPlan | None = None
    token_order: torch.Tensor | None = None
    parts: "tuple[AttentionMetadata, AttentionMetadata] | None" = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    @property
    def max_query_len(self) -> int:
        q = self.query_start_loc_cpu
        return max((q[i + 1] - q[i] for i in range(len(q) - 1)), default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @property
    def phase(self) -> str:
        """prefill (no earlier context), decode (one new token each), verify (new tokens after context)."""
        if self.phase_hint is not None:
            return self.phase_hint
        q = self.query_start_loc_cpu
        qlens = [q[i + 1] - q[i] for i in range(len(q) - 1)]
        if not qlens:
            return "unknown"
        if all(n == 1 for n in qlens) and any(s > 1 for s in self.seq_lens_cpu):
            return "decode"
        if all(n == s for n, s in zip(qlens, self.seq_lens_cpu)):
            return "prefill"
        return "verify"
