"""The dense recent window (`recent_tokens=N`): exact keys/values of each sequence's most recent blocks.

Every token is still quantized into the pages on entry, so pages stay complete (snapshots, tiers, the
prefix cache need nothing from here). Besides, each sequence owns a ring of R = N / block_size + 1
dense blocks per layer (the model's dtype) holding the exact keys/values of its most recent blocks:
logical block b sits in ring slot b % R. Attention over a sequence of length L reads the blocks from
`max(0, (L - N) // block_size)` on from the ring, when the ring holds them whole, and the rest from the
pages: the last N .. N + block_size - 1 tokens are exact.

What the ring holds is one number per sequence, `dense_from`: positions `dense_from .. L - 1` are exact
in the ring (and every block from `ceil(dense_from / block_size)` on is held whole). New tokens move it
to the oldest block still in the ring; a trim lowers it to the new length (a later rewrite of those
positions is exact again, but the block they share with trimmed positions is read from the pages until
it leaves the window); a sequence that starts from cached prefix blocks or a snapshot starts with
`dense_from` at its length, so those tokens are read quantized. Ring slots also record the block they
hold, checked whenever a block is read.

Rings of all sequences live in one tensor per layer, `[num_rows, R, block_size, num_kv_heads, head_dim]`,
a row per sequence (rows are reused after `forget`) and, last, a scratch row that no sequence holds (where the
padding rows of a CUDA-graph step write).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .ops.metadata import WindowPlan


@dataclass
class _Ring:
    row: int
    dense_from: int                                   # positions dense_from .. num_tokens - 1 are exact in the ring
    blocks: list[int] = field(default_factory=list)  # logical block held by each ring slot (-1: none)


class RecentWindow:
    """The dense rings of a `PagedKVCache`'s sequences (one row per sequence, one tensor pair per layer)."""

    def __init__(self, recent_tokens: int, block_size: int):
        assert recent_tokens > 0 and recent_tokens % block_size == 0, "a window is a positive number of blocks"
        self.recent_tokens = recent_tokens
        self.block_size = block_size
        self.num_ring_blocks = recent_tokens // block_size + 1
        self.rings: dict[int, _Ring] = {}  # seq_id -> its ring
        self.free_rows: list[int] = []
        self.num_rows = 0  # rows handed out so far (a layer's tensors grow to hold them on its next write)
        self.keys: dict[int, torch.Tensor] = {}    # layer -> [num_rows, R, block_size, H, D]
        self.values: dict[int, torch.Tensor] = {}  # same

    # ------------------------------------------------------------------------------------------
    # planning a step
    def first_dense_block(self, seq_id: int, length: int) -> int:
        """The first block of a sequence of `length` tokens read from its ring (>= the blocks it has: none)."""
        bs = self.block_size
        start = max(0, (length - self.recent_tokens) // bs)
        ring = self.rings.get(seq_id)
        if ring is None:
            return -(-length // bs)
        first = max(start, -(-ring.dense_from // bs))
        for b in range(first, -(-length // bs)):
            slot = b % self.num_ring_blocks
            assert ring.blocks[slot] == b, f"ring slot {slot} of sequence {seq_id} holds block {ring.blocks[slot]}, not {b}"
        return first

    def place(self, seq_ids: list[int], starts: list[int], counts: list[int]) -> tuple[list[int], ...]:
        """Place the new tokens of each sequence (positions starts[i] .. starts[i] + counts[i] - 1) in its ring;
        returns host lists (token_index, slot_mapping, rows, first_block), the fields of a `WindowPlan`.

        Only the tokens of a step's last R blocks are kept (older ones would be overwritten in the same step).
        """
        bs, nrb = self.block_size, self.num_ring_blocks
        token_index, slots, rows, first_blocks = [], [], [], []
        offset = 0
        for sid, start, n in zip(seq_ids, starts, counts):
            ring = self.rings.get(sid)
            if ring is None:
                ring = self.rings[sid] = _Ring(self._take_row(), dense_from=start, blocks=[-1] * nrb)
            if n:
                end = start + n
                last = (end - 1) // bs
                keep_from = max(start, (last - nrb + 1) * bs)
                for b in range(keep_from // bs, last + 1):
                    ring.blocks[b % nrb] = b
                base = ring.row * nrb * bs
                for p in range(keep_from, end):
                    token_index.append(offset + p - start)
                    slots.append(base + (p // bs % nrb) * bs + p % bs)
                ring.dense_from = max(ring.dense_from, (last - nrb + 1) * bs)  # older blocks were overwritten
            rows.append(ring.row)
            first_blocks.append(self.first_dense_block(sid, start + n))
            offset += n
        return token_index, slots, rows, first_blocks

    def plan(self, seq_ids: list[int], starts: list[int], counts: list[int], device) -> WindowPlan:
        """`place`, as a `WindowPlan` on `device`."""
        token_index, slots, rows, first_blocks = self.place(seq_ids, starts, counts)
        # [2, width]: one copy. Rows of a multiple of 4 int32s, so that first_block starts on 16 bytes as rows does:
        # Triton compiles a kernel again for each alignment of its pointers, which the batch size would otherwise set
        n = len(rows)
        pad = [0] * (-n % 4)
        per_seq = torch.tensor([rows + pad, first_blocks + pad], dtype=torch.int32, device=device)
        return WindowPlan(token_index=torch.tensor(token_index, dtype=torch.int64, device=device),
                          slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
                          rows=per_seq[0, :n], first_block=per_seq[1, :n],
                          rows_cpu=rows, first_block_cpu=first_blocks, num_ring_blocks=self.num_ring_blocks)

    def _take_row(self) -> int:
        if self.free_rows:
            return self.free_rows.pop()
        self.num_rows += 1
        return self.num_rows - 1

    # ------------------------------------------------------------------------------------------
    # tensors
    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A layer's ring tensors [num_rows, R, block_size, H, D] (keys, values), or None before its first write."""
        if layer_idx not in self.keys:
            return None
        return self.keys[layer_idx], self.values[layer_idx]

    def write(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, plan: WindowPlan) -> None:
        """key, value: [num_tokens, H, D] (the step's packed real tokens) in the ring dtype."""
        keys, values = self._tensors(layer_idx, key)
        if plan.slot_mapping.numel():
            flat = (-1, *keys.shape[3:])  # [num_rows * R * block_size, H, D]
            keys.view(flat).index_copy_(0, plan.slot_mapping, key.index_select(0, plan.token_index))
            values.view(flat).index_copy_(0, plan.slot_mapping, value.index_select(0, plan.token_index))

    def _tensors(self, layer_idx: int, key: torch.Tensor, num_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's rings, grown to hold the rows handed out (and `num_rows` rows) plus the scratch row."""
        need = max(self.num_rows, num_rows) + 1
        keys = self.keys.get(layer_idx)
        if keys is None or keys.shape[0] < need:
            have = 0 if keys is None else keys.shape[0]
            rows = max(need, 2 * have, 4)
            shape = (rows, self.num_ring_blocks, self.block_size, *key.shape[1:])
            new_k, new_v = key.new_empty(shape), key.new_empty(shape)
            if keys is not None:
                new_k[:have] = keys
                new_v[:have] = self.values[layer_idx]
            self.keys[layer_idx], self.values[layer_idx] = new_k, new_v
        return self.keys[layer_idx], self.values[layer_idx]

    def reserve(self, num_rows: int) -> None:
        """Every layer's rings hold rows 0 .. num_rows - 1 and the scratch row (CUDA graphs capture the rings at a
        fixed capacity, `pagedkv.engine.cuda_graph`)."""
        for layer_idx, keys in list(self.keys.items()):
            with torch.inference_mode(torch.is_inference(keys)):
                self._tensors(layer_idx, keys[0, 0], num_rows)

    @property
    def scratch_row(self) -> int:
        """A row no sequence holds, the rings' last (rows handed out stay below it once a write or `reserve` has
        grown the rings for them): the padding rows of a CUDA-graph step write there."""
        sizes = {keys.shape[0] for keys in self.keys.values()}
        assert len(sizes) == 1, f"the layers' rings have {sorted(sizes)} rows: a scratch row needs one size"
        return sizes.pop() - 1

    # ------------------------------------------------------------------------------------------
    # sequences
    def trim(self, seq_id: int, num_tokens: int) -> None:
        ring = self.rings.get(seq_id)
        if ring is not None:
            ring.dense_from = min(ring.dense_from, num_tokens)

    def fork(self, seq_id: int, new_seq_id: int) -> None:
        """`new_seq_id` continues `seq_id`: it gets a copy of its ring."""
        ring = self.rings.get(seq_id)
        if ring is None:
            return
        child = self.rings[new_seq_id] = _Ring(self._take_row(), ring.dense_from, list(ring.blocks))
        self.copy_row(ring.row, child.row)

    def copy_row(self, src: int, dst: int) -> None:
        """Ring row `dst` becomes a copy of row `src`, in every layer."""
        self.num_rows = max(self.num_rows, src + 1, dst + 1)
        for layer_idx in list(self.keys):
            # rings written under inference mode (the engine) are inference tensors: copy in that mode too
            with torch.inference_mode(torch.is_inference(self.keys[layer_idx])):
                keys, values = self._tensors(layer_idx, self.keys[layer_idx][0, 0])
                keys[dst].copy_(keys[src])
                values[dst].copy_(values[src])

    def forget(self, seq_id: int) -> None:
        ring = self.rings.pop(seq_id, None)
        if ring is not None:
            self.free_rows.append(ring.row)

    def clear(self) -> None:
        self.rings.clear()
        self.free_rows.clear()
        self.num_rows = 0

    # ------------------------------------------------------------------------------------------
    # stats
    def nbytes(self) -> int:
        """Bytes of the ring tensors allocated, all layers."""
        return sum(t.numel() * t.element_size() for d in (self.keys, self.values) for t in d.values())

    def bytes_per_sequence(self) -> int:
        """Bytes one sequence's rings take, all layers."""
        return sum(t[0].numel() * t.element_size() for d in (self.keys, self.values) for t in d.values())

    def stats(self) -> dict:
        return {"recent_tokens": self.recent_tokens, "window_bytes": self.nbytes(),
                "window_bytes_in_use": len(self.rings) * self.bytes_per_sequence(),
                "window_sequences": len(self.rings)}
