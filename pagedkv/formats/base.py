"""The storage-format protocol.

A format says which tensors one page slot needs (per KV head: a width and a dtype), how to encode new
keys/values into them, and how to decode them back (PyTorch, any device). Page tensors are
`[num_blocks, block_size, num_kv_heads, width]`, stored head-major (`empty_pages`); scales live in sibling
tensors of the same layout. Kernels specialise on a format through compile-time constants and are tested
against `decode`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..config import KVFormat


def empty_pages(num_blocks: int, block_size: int, num_kv_heads: int, width: int, dtype: torch.dtype,
                device) -> torch.Tensor:
    """A page tensor indexed `[num_blocks, block_size, num_kv_heads, width]`, stored head-major (in memory
    `[num_blocks, num_kv_heads, block_size, width]`): a block's slots of one KV head lie side by side, so a decode
    program, which reads one head, copies whole runs of `block_size * width` bytes instead of `width`-byte pieces
    (H200: q4 decode 1.14-1.19x, q6 1.05-1.13x, TurboQuant 1.04-1.11x faster; BENCHMARKS.md, 2026-12-02).
    Not zeroed: no path reads a slot before it is written (kernels mask every load past a sequence's length
    with `other=0`, the reference gathers only written slots), and on the CPU untouched pages cost no resident
    memory until they are used."""
    return torch.empty(num_blocks, num_kv_heads, block_size, width, dtype=dtype, device=device).transpose(1, 2)


def stored_blocks(page: torch.Tensor) -> torch.Tensor:
    """`page` as stored: [num_blocks, num_kv_heads, block_size, width], contiguous."""
    return page.transpose(1, 2)


def grown(page: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A page tensor of `num_blocks` blocks (at least as many as `page`'s) holding `page`'s blocks first, stored
    the same way."""
    out = empty_pages(num_blocks, page.shape[1], page.shape[2], page.shape[3], page.dtype, page.device)
    out[:page.shape[0]].copy_(page)
    return out


def read_positions(page: torch.Tensor, block_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows [len(positions), num_kv_heads, width] of one sequence at `positions`, its blocks `block_ids` (int64)."""
    return page[block_ids[positions // page.shape[1]], positions % page.shape[1]]


def read_slots(page: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows [len(slots), num_kv_heads, width] of `page` at flat slot indices (block * block_size + offset)."""
    return page[slots // page.shape[1], slots % page.shape[1]]


def write_slots(page: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """`page` at flat slot indices `slots` (distinct) = `rows` [len(slots), num_kv_heads, width]."""
    page.index_put_((slots // page.shape[1], slots % page.shape[1]), rows.to(page.dtype))


class PageFormat(ABC):
    """One layer's storage format, bound to its shapes.

    Attributes: `spec` (the `KVFormat`), `num_kv_heads`, `head_dim`, `dtype` (the model's compute dtype:
    what `decode` returns and what dense pages store), `device`.
    """

    # Names the byte layout of the codes inside a page; it changes whenever that layout does, so pages saved
    # in an older layout (snapshots, the disk tier) are refused instead of misread (`identity`).
    page_layout = "1"

    def __init__(self, spec: KVFormat, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.spec = spec
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)

    @abstractmethod
    def page_spec(self) -> dict[str, tuple[int, torch.dtype]]:
        """Page tensor name -> (width per KV head, dtype)."""

    @abstractmethod
    def encode(self, key: torch.Tensor, value: torch.Tensor) -> dict[str, torch.Tensor]:
        """key, value: [N, num_kv_heads, head_dim] -> {name: [N, num_kv_heads, width]}."""

    @abstractmethod
    def decode(self, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """{name: [N, num_kv_heads, width]} -> key, value [N, num_kv_heads, head_dim] in `self.dtype`."""

    # Attention may run in a transformed domain (TurboQuant: rotated values, optionally rotated keys).
    # Scores and outputs over these three equal attention over `decode`.
    def attention_query(self, query: torch.Tensor) -> torch.Tensor:
        """query [num_tokens, num_q_heads, head_dim] -> the query in the keys' attention domain."""
        return query

    def decode_for_attention(self, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Like `decode`, but keys/values may stay in the attention domain (and in float32)."""
        return self.decode(parts)

    def attention_output(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output [num_tokens, num_q_heads, head_dim] in the values' domain -> the model's domain."""
        return out

    def bytes_per_token_per_head(self) -> int:
        """Bytes one token occupies for one KV head (keys and values, scales included)."""
        return sum(width * torch.empty((), dtype=dt).element_size() for width, dt in self.page_spec().values())

    def bytes_per_token(self) -> int:
        return self.bytes_per_token_per_head() * self.num_kv_heads

    def allocate_pages(self, num_blocks: int, block_size: int) -> dict[str, torch.Tensor]:
        return {name: empty_pages(num_blocks, block_size, self.num_kv_heads, width, dt, self.device)
                for name, (width, dt) in self.page_spec().items()}
