"""Cache writes: encode new keys/values per the layer's format and scatter them to their slots in one pass.

Grid: (num_input_tokens, num_kv_heads). Each program encodes one head of one input position; a negative
slot (padding) is skipped on the device, so the launch is the same for every step of a given shape.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...formats.base import PageFormat
from ..metadata import AttentionMetadata
from .codecs import KVQUANT, TURBOQUANT, encode_kvquant, encode_turboquant_keys, encode_turboquant_values, fwht
from .gluon_support import compiled
from .page_view import PageView, page_view, stride3

# TurboQuant's value-scale search for codebooks of up to 4 bits (`codecs.search_scales`): candidate scales scored at a
# time, and the warps of a program per 128 channels (one warp at head_dim 64 too; at 256 one warp would spill). More
# warps split a program's fixed work (the rotation, the key codes, packing) into exchanges between warps: on an H200
# (K q8_0 / V q3_0, 8 KV heads of 128), 1 / 2 / 4 warps took 6.9 / 5.9 / 5.7 us for 64 decode tokens, 7.4 / 8.0 /
# 8.7 for 128 and 77 / 86 / 102 for a 2,048-token chunk (searching one candidate at a time: 12.1, 13.7, 127.5).
# Other formats, and 5- and 8-bit values (`codecs.search_scales_one_by_one`), write with one warp per program.
TQ_CANDIDATES = 8
TQ_WARPS = 1
# a register cap for TurboQuant writes of at least TQ_CAP_TOKENS input tokens (prefill chunks; None: no cap): the one-warp
# programs hold 90 registers, so an SM keeps 22 of them, not the 32 its block limit allows at 64 (prepared, untimed)
TQ_MAX_REGISTERS: int | None = None
TQ_CAP_TOKENS = 256


@triton.jit
def write_kv_kernel(
    key_ptr, value_ptr, slot_mapping_ptr,
    k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, thresholds_ptr, codebook_ptr, multipliers_ptr, key_signs_ptr, value_signs_ptr,
    scratch_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
    k_strides, v_strides, ks_strides, vs_strides,      # (block, slot, head) of each page tensor
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KIND: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr, ROTATE_KEYS: tl.constexpr,
    LOG2_HEAD_DIM: tl.constexpr, SQRT_HEAD_DIM: tl.constexpr, NUM_MULTIPLIERS: tl.constexpr,
    CANDIDATES: tl.constexpr, COMPILED: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    zero = tl.zeros([1], dtype=tl.int64)                     # rows are [1, HEAD_DIM_PAD] tiles
    d_ok = (offs_d < HEAD_DIM)[None, :]
    key = tl.load(key_ptr + t * stride_kt + head * stride_kh + zero[:, None] + offs_d[None, :], mask=d_ok, other=0.0)
    value = tl.load(value_ptr + t * stride_vt + head * stride_vh + zero[:, None] + offs_d[None, :], mask=d_ok, other=0.0)
    k_row = zero + block * k_strides[0] + offset * k_strides[1] + head * k_strides[2]
    v_row = zero + block * v_strides[0] + offset * v_strides[1] + head * v_strides[2]
    if KIND == KVQUANT or KIND == TURBOQUANT:
        ks_row = zero + block * ks_strides[0] + offset * ks_strides[1] + head * ks_strides[2]
        vs_row = zero + block * vs_strides[0] + offset * vs_strides[1] + head * vs_strides[2]
        x = key.to(tl.float32)
        if ROTATE_KEYS:  # hadamard.rotate(x, signs) = fwht(x * signs) / sqrt(head_dim)
            x = fwht(x * tl.load(key_signs_ptr + offs_d)[None, :], HEAD_DIM, LOG2_HEAD_DIM) / SQRT_HEAD_DIM
        if KIND == KVQUANT:
            encode_kvquant(k_ptr, ks_ptr, k_row, ks_row, x, HEAD_DIM, K_BITS)
            encode_kvquant(v_ptr, vs_ptr, v_row, vs_row, value.to(tl.float32), HEAD_DIM, V_BITS)
        else:
            encode_turboquant_keys(k_ptr, ks_ptr, kz_ptr, k_row, ks_row, x, HEAD_DIM, K_BITS)
            x = fwht(value.to(tl.float32) * tl.load(value_signs_ptr + offs_d)[None, :], HEAD_DIM,
                     LOG2_HEAD_DIM) / SQRT_HEAD_DIM
            scratch = scratch_ptr + (t * tl.num_programs(1) + head) * HEAD_DIM   # 3-, 4-bit codes' trip through memory
            encode_turboquant_values(v_ptr, vs_ptr, thresholds_ptr, codebook_ptr, multipliers_ptr, v_row, vs_row, x,
                                     scratch, HEAD_DIM, V_BITS, NUM_MULTIPLIERS, CANDIDATES, COMPILED)
    else:
        tl.store(k_ptr + k_row[:, None] + offs_d[None, :], key.to(k_ptr.dtype.element_ty), mask=d_ok)
        tl.store(v_ptr + v_row[:, None] + offs_d[None, :], value.to(v_ptr.dtype.element_ty), mask=d_ok)


def write_kv(pages: dict[str, torch.Tensor], fmt: PageFormat, key: torch.Tensor, value: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """Same contract as `reference.write_kv`: key, value [num_input_tokens, num_kv_heads, head_dim];
    meta.slot_mapping [num_input_tokens] int64, negative slots skipped."""
    view: PageView = page_view(fmt, pages)
    num_input_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, f"key {tuple(key.shape)} and value {tuple(value.shape)} differ"
    assert (num_kv_heads, head_dim) == (view.num_kv_heads, view.head_dim), \
        f"keys have {num_kv_heads} heads x {head_dim}, pages {view.num_kv_heads} x {view.head_dim}"
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "key/value need a contiguous head_dim"
    slots = meta.slot_mapping
    assert slots.dtype == torch.int64 and slots.shape[0] == num_input_tokens, \
        f"slot_mapping must be int64 [{num_input_tokens}], got {slots.dtype} {tuple(slots.shape)}"
    if num_input_tokens == 0:
        return
    # 3- and 4-bit TurboQuant values pass through a scratch row per token and head; other pages read none of it
    scratch = torch.empty(num_input_tokens * num_kv_heads * head_dim, dtype=torch.int8, device=key.device) \
        if view.kind == TURBOQUANT and view.v_bits in (3, 4) else view.k
    write_kv_kernel[(num_input_tokens, num_kv_heads)](
        key, value, slots, view.k, view.v, view.k_scale, view.k_zero, view.v_scale,
        view.aux("thresholds"), view.aux("codebook"), view.aux("scale_multipliers"), view.aux("key_signs"),
        view.aux("value_signs"), scratch,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        stride3(view.k), stride3(view.v), stride3(view.k_scale), stride3(view.v_scale),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=meta.block_size,
        KIND=view.kind, K_BITS=view.k_bits, V_BITS=view.v_bits, ROTATE_KEYS=view.rotate_keys,
        LOG2_HEAD_DIM=head_dim.bit_length() - 1, SQRT_HEAD_DIM=math.sqrt(head_dim),
        NUM_MULTIPLIERS=0 if view.scale_multipliers is None else view.scale_multipliers.numel(),
        CANDIDATES=TQ_CANDIDATES, COMPILED=compiled(),
        num_warps=TQ_WARPS * max(1, head_dim // 128) if view.kind == TURBOQUANT and view.v_bits <= 4 else 1,
        **({"maxnreg": TQ_MAX_REGISTERS} if TQ_MAX_REGISTERS and view.kind == TURBOQUANT
           and num_input_tokens >= TQ_CAP_TOKENS else {}),
    )
