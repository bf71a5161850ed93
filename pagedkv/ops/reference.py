"""Reference paged attention and cache writes in PyTorch: any device, float32 accumulation.

Same signatures as the Triton wrappers. Attention handles one sequence at a time and never holds more
than that sequence's context decoded (queries are processed in chunks to bound the score matrix).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..formats.base import PageFormat, write_slots
from .metadata import AttentionMetadata

QUERY_CHUNK = 512


def write_kv(pages: dict[str, torch.Tensor], fmt: PageFormat, key: torch.Tensor, value: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """Encode and scatter new keys/values into their slots.

    key, value: [num_input_tokens, num_kv_heads, head_dim]; meta.slot_mapping: [num_input_tokens] int64,
    negative slots (padding) are skipped.
    """
    slots = meta.slot_mapping
    if meta.token_index is not None:
        key, value, slots = key[meta.token_index], value[meta.token_index], slots[meta.token_index]
    parts = fmt.encode(key, value)
    for name, part in parts.items():
        write_slots(pages[name], slots, part)


def gather_sequence(pages: dict[str, torch.Tensor], block_ids: torch.Tensor, length: int) -> dict[str, torch.Tensor]:
    """The first `length` slots of one sequence: {name: [length, H, width]}."""
    out = {}
    for name, page in pages.items():
        rows = page.index_select(0, block_ids)  # [n_blocks, block_size, H, width]
        out[name] = rows.reshape(-1, *page.shape[2:])[:length]
    return out


def gather_ring(ring: torch.Tensor, row: int, first_block: int, length: int, block_size: int) -> torch.Tensor:
    """Positions first_block * block_size .. length - 1 of one sequence's dense ring: [n, H, D].

    ring: [num_rows, num_ring_blocks, block_size, H, D]; logical block b sits in slot b % num_ring_blocks.
    """
    slots = torch.arange(first_block, -(-length // block_size), device=ring.device) % ring.shape[1]
    return ring[row].index_select(0, slots).reshape(-1, *ring.shape[3:])[:length - first_block * block_size]


def window_kv(pages: dict[str, torch.Tensor], fmt: PageFormat, meta: AttentionMetadata, i: int,
              ring: tuple[torch.Tensor, torch.Tensor],
              body: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys/values [seq_len, H, D] of sequence i: from block `meta.window.first_block_cpu[i]` on its exact
    ones from the dense ring, before it the pages decoded (`fmt.decode`: the model's domain), or `body`
    (keys/values [>= that position, H, D] decoded elsewhere, a KV-Quant mirror)."""
    length, bs = meta.seq_lens_cpu[i], meta.block_size
    first = meta.window.first_block_cpu[i]
    start = first * bs
    if body is not None:
        k, v = body[0][:start], body[1][:start]
    else:
        parts = gather_sequence(pages, meta.block_table[i, :first].long(), start)
        k, v = fmt.decode(parts)  # [start, H, D]
    row = meta.window.rows_cpu[i]
    tk, tv = (gather_ring(r, row, first, length, bs) for r in ring)
    dtype = torch.promote_types(k.dtype, tk.dtype)
    return torch.cat([k.to(dtype), tk.to(dtype)]), torch.cat([v.to(dtype), tv.to(dtype)])


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, sliding_window: int | None,
           softcap: float | None) -> torch.Tensor:
    """Causal attention of the last `nq` positions of a sequence over all `L` of its keys.

    q: [nq, Hq, D]; k, v: [L, Hkv, D]; returns [nq, Hq, Dv] float32 (float64 for float64 queries: a float32
    product's rounding depends on how many queries a call holds, which could move a later layer's code between a
    verify and a decode step). Without a softcap this is one fused
    SDPA call per query chunk (the G query heads of a KV head ride along the query axis, so keys and
    values are never repeated); with a softcap the scores are formed explicitly.
    """
    nq, hq, d = q.shape
    length, hkv, dv = v.shape
    group = hq // hkv
    dt = torch.promote_types(q.dtype, torch.float32)
    qf = q.to(dt).view(nq, hkv, group, d)
    kf, vf = k.to(dt), v.to(dt)
    out = torch.empty(nq, hkv, group, dv, dtype=dt, device=q.device)
    key_pos = torch.arange(length, device=q.device)
    for start in range(0, nq, QUERY_CHUNK):
        stop = min(nq, start + QUERY_CHUNK)
        n = stop - start
        allowed = None  # [n, L] True where a query may attend
        if n > 1 or stop < nq or sliding_window:
            q_pos = torch.arange(length - nq + start, length - nq + stop, device=q.device)
            allowed = key_pos[None, :] <= q_pos[:, None]
            if sliding_window:
                allowed &= key_pos[None, :] > q_pos[:, None] - sliding_window
        if softcap:
            scores = torch.einsum("qhgd,khd->hgqk", qf[start:stop], kf) * scale  # [Hkv, G, n, L]
            scores = torch.tanh(scores / softcap) * softcap
            if allowed is not None:
                scores = scores.masked_fill(~allowed, float("-inf"))
            out[start:stop] = torch.einsum("hgqk,khd->qhgd", torch.softmax(scores, dim=-1), vf)
            continue
        # [1, Hkv, G*n, D] against [1, Hkv, L, D]
        qs = qf[start:stop].permute(1, 2, 0, 3).reshape(1, hkv, group * n, d)
        mask = None if allowed is None else allowed.expand(group, n, length).reshape(group * n, length)
        o = F.scaled_dot_product_attention(qs, kf.transpose(0, 1)[None], vf.transpose(0, 1)[None], attn_mask=mask,
                                           scale=scale)
        out[start:stop] = o.view(hkv, group, n, dv).permute(2, 0, 1, 3)
    return out.view(nq, hq, dv)


def paged_attention(query: torch.Tensor, pages: dict[str, torch.Tensor], fmt: PageFormat, meta: AttentionMetadata,
                    *, scale: float, sliding_window: int | None = None, softcap: float | None = None,
                    sequence_kv: Callable[[int], tuple[torch.Tensor, torch.Tensor] | None] | None = None) -> torch.Tensor:
    """Attention of packed queries over paged keys/values.

    query: [num_tokens, num_q_heads, head_dim] (sequence i owns rows query_start_loc[i]:query_start_loc[i+1]);
    returns [num_tokens, num_q_heads, head_dim] in query.dtype. Causal: a query at position p of its
    sequence sees keys 0..p (its sequence's last nq positions are the queries); `sliding_window` keeps
    keys > p - window; `softcap` applies cap * tanh(score / cap) before the softmax.
    `sequence_kv(i)`, when given, supplies sequence i's decoded keys/values [seq_len, H, D] (a dense
    mirror) instead of decoding its pages; it returns None for sequences read from the pages.
    The format's attention domain is honoured: queries go in through `fmt.attention_query`, the output
    comes back through `fmt.attention_output` (pages only; a mirror holds decoded keys/values).
    """
    out = torch.empty_like(query)
    qsl = meta.query_start_loc_cpu
    bs = meta.block_size
    for i, length in enumerate(meta.seq_lens_cpu):
        q0, q1 = qsl[i], qsl[i + 1]
        if q1 == q0:
            continue
        kv = sequence_kv(i) if sequence_kv is not None else None
        if kv is not None:
            o = attend(query[q0:q1], *kv, scale=scale, sliding_window=sliding_window, softcap=softcap)
        else:
            n_blocks = -(-length // bs)
            parts = gather_sequence(pages, meta.block_table[i, :n_blocks].long(), length)
            k, v = fmt.decode_for_attention(parts)
            o = attend(fmt.attention_query(query[q0:q1]), k, v, scale=scale, sliding_window=sliding_window,
                       softcap=softcap)
            o = fmt.attention_output(o)
        out[q0:q1] = o.to(out.dtype)
    return out
