"""The dense mirror of KV-Quant pages, and the attention route latched per request.

KV-Quant keeps, beside its packed pages, a dense copy of the tokens it has already decoded (dtype from
`kv_quant_config["dtype"]`), one per (sequence, layer). The reference attention reads that copy, so a
decode step decodes only its new tokens. Which route a request takes -- "mirror" (reference attention
over the dense copy) or "direct" (attention reads the packed pages) -- is chosen at its first attention
call and kept until the sequence is freed, across `trim` too: a speculative rollback never switches
the math of a request halfway.

Positions a trim removes are dropped from the mirror, so rewritten positions are decoded again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats.base import read_positions

MIRROR, DIRECT = "mirror", "direct"


@dataclass
class _Buffer:
    keys: torch.Tensor    # [capacity, num_kv_heads, head_dim] in the mirror dtype
    values: torch.Tensor  # same
    length: int = 0       # positions 0..length-1 are decoded and current


class DequantMirror:
    """Per-request routes and the dense copies of decoded KV-Quant tokens (owned by a `PagedKVCache`)."""

    def __init__(self):
        self.routes: dict[int, str] = {}
        self.buffers: dict[tuple[int, int], _Buffer] = {}  # (seq_id, layer_idx) -> buffer
        self.last_route: str | None = None
        self.dequant_tokens = 0  # tokens decoded into the mirror, summed over layers
        self.hits = 0            # tokens served from the mirror without decoding, summed over layers

    def layer(self, layer_idx: int) -> "LayerMirror":
        return LayerMirror(self, layer_idx)

    def latch(self, seq_ids: list[int], proposed: str) -> list[str]:
        """The route of each sequence: its latched one, or `proposed` for a request's first call."""
        for sid in seq_ids:
            if sid not in self.routes:
                self.routes[sid] = proposed
                self.last_route = proposed
        return [self.routes[sid] for sid in seq_ids]

    def sequence_kv(self, seq_id: int, layer_idx: int, pages: dict[str, torch.Tensor], fmt, block_ids: torch.Tensor,
                    length: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values [length, num_kv_heads, head_dim] of one sequence, decoding only the positions not yet mirrored.

        block_ids: [>= ceil(length / block_size)] int64, the sequence's row of the block table.
        """
        buf = self.buffers.get((seq_id, layer_idx))
        done = min(buf.length, length) if buf is not None else 0
        if done < length:
            positions = torch.arange(done, length, device=block_ids.device)
            parts = {name: read_positions(page, block_ids, positions) for name, page in pages.items()}
            k, v = fmt.decode(parts)  # [n_new, H, D]
            buf = self._extend(seq_id, layer_idx, buf, done, k.to(fmt.mirror_dtype), v.to(fmt.mirror_dtype))
            self.dequant_tokens += length - done
        buf.length = length
        self.hits += done
        return buf.keys[:length], buf.values[:length]

    def _extend(self, seq_id, layer_idx, buf, start: int, k: torch.Tensor, v: torch.Tensor) -> _Buffer:
        need = start + k.shape[0]
        if buf is None or buf.keys.shape[0] < need:
            capacity = max(need, 2 * buf.keys.shape[0] if buf is not None else 0, 16)
            keys = k.new_empty((capacity, *k.shape[1:]))
            values = v.new_empty((capacity, *v.shape[1:]))
            if buf is not None:
                keys[:start] = buf.keys[:start]
                values[:start] = buf.values[:start]
            buf = self.buffers[(seq_id, layer_idx)] = _Buffer(keys, values)
        buf.keys[start:need] = k
        buf.values[start:need] = v
        return buf

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Sequence `seq_id` now holds `num_tokens` tokens: forget mirrored positions past that (route kept)."""
        for (sid, _), buf in self.buffers.items():
            if sid == seq_id:
                buf.length = min(buf.length, num_tokens)

    def fork(self, seq_id: int, new_seq_id: int) -> None:
        """`new_seq_id` continues `seq_id` (a sample or a beam): it keeps its route; its copy is decoded afresh
        from the shared pages when first read (the same values)."""
        if seq_id in self.routes:
            self.routes[new_seq_id] = self.routes[seq_id]

    def forget(self, seq_id: int) -> None:
        """The request is over: drop its route and its copies."""
        self.routes.pop(seq_id, None)
        for key in [key for key in self.buffers if key[0] == seq_id]:
            del self.buffers[key]

    def clear(self) -> None:
        self.routes.clear()
        self.buffers.clear()

    def nbytes(self) -> int:
        return sum(b.keys.numel() * b.keys.element_size() * 2 for b in self.buffers.values())

    def stats(self) -> dict:
        return {"kv_quant_route": self.last_route, "kv_quant_dequant_tokens": self.dequant_tokens,
                "kv_quant_mirror_hits": self.hits, "kv_quant_mirror_bytes": self.nbytes()}


@dataclass(frozen=True)
class LayerMirror:
    """The mirror as one layer's attention sees it."""

    mirror: DequantMirror
    layer_idx: int

    def latch(self, seq_ids: list[int], proposed: str) -> list[str]:
        return self.mirror.latch(seq_ids, proposed)

    def sequence_kv(self, seq_id, pages, fmt, block_ids, length, block_size):
        return self.mirror.sequence_kv(seq_id, self.layer_idx, pages, fmt, block_ids, length, block_size)
