"""Stream-K decode: a batch's key steps divided evenly over a fixed grid of programs, one per resident slot.

The split decode (`split_k.py`, the Gluon kernels' splits) gives every (query token, KV head) pair the same number
of key ranges, so a batch makes pairs x splits programs whatever the GPU holds at once: 100 sequences over 8 KV
heads in 2 splits are 1,600 one-warp programs where 2,112 fit an H200 (16 a multiprocessor), and 3 splits are 2,400,
a full wave and a seventh. Here the grid is the resident slots, P programs, and the batch's work is one line of
16-key steps: token t's pairs one after another (head h of token t covers the steps [a_t + h s_t, a_t + (h + 1)
s_t), s_t = ceil(keys_t / 16), a_t = H (s_0 + .. + s_{t-1})), cut into P equal pieces of `chunk` steps. A program
walks its piece pair by pair; each piece of a pair it attends (a segment) ends in a partial softmax state. Nothing
is planned on the host: every program finds its first pair from the batch's lengths on the device (two vector
passes over `seq_lens`, one load of them up to 256 tokens), so the launch is the same for every step and CUDA graphs
replay it.

Partial states: the state of pair j = t H + h from program p lies in slot p + j. Slots are unique: a program that
reaches pair j ends at or after j's first step, so the next program starts after it and cannot touch an earlier
pair. A pair's slots are contiguous, from its first program (a_j // chunk) to its last ((a_j + s_j - 1) // chunk),
so the reduce (`reduce_stream_kernel`, one program per query token and head) finds them from the lengths alone.
Buffers: (P + num_tokens H) slots of GROUP query heads each (`stream_states`).

Decode batches only (one query token per sequence, token t of sequence t), no dense recent window, power-of-two
head_dim (`streams`): the kernels keep their splits for the rest. The Gluon kernels (`decode_gluon.stream_programs`:
q8, q4 / q6, TurboQuant) and the tile-language one (`decode.paged_attention(stream=...)`, `decode_transposed.py`)
walk the line with the same functions (`next_segment`, `stream_chunk`). `segments` is the plan in Python, for tests
and tools.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .codecs import fwht

KEYS_PER_STEP = 16   # the unit of the line (the kernels' functions write it out): one ring step of the Gluon kernels
# Steps a program attends at least (128 keys): a batch too small to give every slot that many leaves slots idle
# rather than cutting pairs into pieces whose query loads and partial states cost more than their keys
MIN_STEPS = 8
SCAN_BLOCK = tl.constexpr(256)   # tokens a vector pass over the lengths reads at once (kernels read it as a global)
# Partial states the reduce merges at once: 4 where the batch has a pair for every two programs or more (a pair then
# has 1-3 at equal lengths), else 16 (fewer pairs, more pieces each)
REDUCE_SLOTS = (4, 16)


def segments(seq_lens, num_kv_heads: int, num_programs: int, min_steps: int = MIN_STEPS) -> list[list[tuple]]:
    """The plan in Python: for each program, its segments (token, kv_head, kv_lo, kv_hi, slot) in order, keys
    [kv_lo, kv_hi) of the pair's sequence, its partial state in `slot`."""
    steps = [-(-int(n) // KEYS_PER_STEP) for n in seq_lens]
    total = num_kv_heads * sum(steps)
    chunk = max(min_steps, -(-total // num_programs))
    starts, a = [], 0
    for s in steps:
        starts.append(a)
        a += num_kv_heads * s
    plan = []
    for p in range(num_programs):
        g, g_end, out = p * chunk, min((p + 1) * chunk, total), []
        t = 0
        while g < g_end:
            while g >= starts[t] + num_kv_heads * steps[t]:
                t += 1
            h = (g - starts[t]) // steps[t]
            lo = starts[t] + h * steps[t]
            end = min(g_end, lo + steps[t])
            out.append((t, h, (g - lo) * KEYS_PER_STEP, min(int(seq_lens[t]), (end - lo) * KEYS_PER_STEP),
                        p + t * num_kv_heads + h))
            g = end
        plan.append(out)
    return plan


def one_token_each(meta, num_tokens: int) -> bool:
    """Whether the batch is a decode: query token t is sequence t's one."""
    return num_tokens == meta.block_table.shape[0] and meta.query_start_loc_cpu == list(range(num_tokens + 1))


def streams(query: torch.Tensor, meta, window) -> bool:
    """Whether a stream-K decode reads this batch: a decode (`one_token_each`) without a dense recent window, at a
    power-of-two head_dim (the reduce's rotation back and partial states assume one)."""
    head_dim = query.shape[-1]
    return (window is None and head_dim == 1 << (head_dim.bit_length() - 1)
            and one_token_each(meta, query.shape[0]))


def resident_programs(per_sm: int, device: torch.device) -> int:
    """per_sm programs on each multiprocessor of a CUDA device; off one (compile-only reports), an H200's 132."""
    if device.type != "cuda":
        return per_sm * 132
    from .tuning import multiprocessor_count

    return per_sm * multiprocessor_count(device.index if device.index is not None else torch.cuda.current_device())


def num_slots(num_tokens: int, num_kv_heads: int, num_programs: int) -> int:
    """Partial-state slots of a stream-K decode: one per program, plus one per pair (a pair's first segment may
    share its program with the previous pair's last)."""
    return num_programs + num_tokens * num_kv_heads


def stream_states(query: torch.Tensor, num_kv_heads: int, num_programs: int):
    """Buffers for the partial states of a stream-K decode of queries [num_tokens, num_q_heads, head_dim]: out
    [slots * group, head_dim] (unnormalised, float32), max (log2 units) and sum [slots * group], state
    slot * group + g for query head g of the slot's pair."""
    num_tokens, num_q_heads, head_dim = query.shape
    states = num_slots(num_tokens, num_kv_heads, num_programs) * (num_q_heads // num_kv_heads)
    part_out = torch.empty(states, head_dim, dtype=torch.float32, device=query.device)
    part_m = torch.empty(states, dtype=torch.float32, device=query.device)
    return part_out, part_m, torch.empty_like(part_m)


@triton.jit
def stream_chunk(total, num_programs, MIN_STEPS: tl.constexpr):
    """Steps each program attends (the last ones may get fewer, or none)."""
    return tl.maximum(tl.cdiv(total, num_programs), MIN_STEPS)


@triton.jit
def next_segment(g, g_end, t, a, s, seq_lens_ptr, program, HEADS: tl.constexpr):
    """The segment from step g of a program whose piece ends at g_end, token t's pairs (s steps each) starting at
    step a, g in them or in a later token's (scalar work: the Gluon kernels call it too). Returns (t, a, s) moved on
    to the token whose pairs hold g, then the segment: (kv_head, kv_lo, kv_hi, slot, the step after it)."""
    while g >= a + HEADS * s:
        a += HEADS * s
        t += 1
        s = tl.cdiv(tl.load(seq_lens_ptr + t), 16)
    h = (g - a) // s
    lo = a + h * s
    end = tl.minimum(g_end, lo + s)
    kv_hi = tl.minimum(tl.load(seq_lens_ptr + t), (end - lo) * 16)
    return t, a, s, h, (g - lo) * 16, kv_hi, program + t * HEADS + h, end


@triton.jit
def steps_before(seq_lens_ptr, num_tokens, token, BLOCK: tl.constexpr):
    """(the batch's 16-key steps per KV head, those of the tokens before `token`): one vector pass."""
    offs = tl.arange(0, BLOCK)
    total = 0
    before = 0
    for base in range(0, num_tokens, BLOCK):
        t = base + offs
        s = tl.cdiv(tl.load(seq_lens_ptr + t, mask=t < num_tokens, other=0), 16)
        total += tl.sum(s, axis=0)
        before += tl.sum(tl.where(t < token, s, 0), axis=0)
    return total, before


@triton.jit
def first_pair(seq_lens_ptr, num_tokens, g, HEADS: tl.constexpr, BLOCK: tl.constexpr):
    """(t, a): the first token whose pairs end past step g, and the step they start at (one vector pass: the tokens
    whose pairs all end at or before g come first)."""
    offs = tl.arange(0, BLOCK)
    run = 0
    t = 0
    a = 0
    for base in range(0, num_tokens, BLOCK):
        s = tl.cdiv(tl.load(seq_lens_ptr + base + offs, mask=base + offs < num_tokens, other=0), 16)
        done = (run + tl.cumsum(s, axis=0)) * HEADS <= g
        t += tl.sum(done.to(tl.int32), axis=0)
        a += tl.sum(tl.where(done, s, 0), axis=0)
        run += tl.sum(s, axis=0)
    return t, a * HEADS


@triton.jit
def stream_piece(seq_lens_ptr, num_tokens, HEADS: tl.constexpr, MIN_STEPS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's piece of the line (`decode_gluon.stream_piece` in the tile language): (g, g_end, t, a, s), the
    steps [g, g_end) it attends, the token t whose pairs hold step g (when g < g_end), the step a they start at and
    s, its steps a pair."""
    total, _ = steps_before(seq_lens_ptr, num_tokens, 0, BLOCK)
    total *= HEADS
    chunk = stream_chunk(total, tl.num_programs(0), MIN_STEPS)
    g = tl.program_id(0) * chunk
    t, a = first_pair(seq_lens_ptr, num_tokens, g, HEADS, BLOCK)
    s = tl.cdiv(tl.load(seq_lens_ptr + tl.minimum(t, num_tokens - 1)), 16)   # t == num_tokens: an idle program
    return g, tl.minimum(g + chunk, total), t, a, s


@triton.jit(do_not_specialize=["num_tokens"])
def plan_kernel(out_ptr, seq_lens_ptr, num_tokens, HEADS: tl.constexpr, MAX_SEGMENTS: tl.constexpr,
                MIN_STEPS: tl.constexpr, BLOCK: tl.constexpr):
    """Each program's segments as the kernels walk them (the same functions), written to out [programs,
    MAX_SEGMENTS, 5] as (token, kv_head, kv_lo, kv_hi, slot) rows, -1 past the last: `device_segments`."""
    p = tl.program_id(0)
    g, g_end, t, a, s = stream_piece(seq_lens_ptr, num_tokens, HEADS, MIN_STEPS, BLOCK)
    k = 0
    row = out_ptr + p * MAX_SEGMENTS * 5
    while g < g_end:
        t, a, s, h, kv_lo, kv_hi, slot, g = next_segment(g, g_end, t, a, s, seq_lens_ptr, p, HEADS)
        if k < MAX_SEGMENTS:
            tl.store(row + 5 * k, t)
            tl.store(row + 5 * k + 1, h)
            tl.store(row + 5 * k + 2, kv_lo)
            tl.store(row + 5 * k + 3, kv_hi)
            tl.store(row + 5 * k + 4, slot)
        k += 1


def device_segments(seq_lens: torch.Tensor, num_kv_heads: int, num_programs: int, max_segments: int = 8,
                    min_steps: int = MIN_STEPS) -> list[list[tuple]]:
    """`segments` as the kernels' own functions compute them on `seq_lens`' device (tests, tools)."""
    out = torch.full((num_programs, max_segments, 5), -1, dtype=torch.int32, device=seq_lens.device)
    plan_kernel[(num_programs,)](out, seq_lens, seq_lens.shape[0], HEADS=num_kv_heads, MAX_SEGMENTS=max_segments,
                                 MIN_STEPS=min_steps, BLOCK=SCAN_BLOCK.value)
    return [[tuple(int(x) for x in row) for row in rows if row[0] >= 0] for rows in out.cpu().tolist()]


@triton.jit(do_not_specialize=["num_tokens", "num_programs"])
def reduce_stream_kernel(
    out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, signs_ptr, seq_lens_ptr, stride_ot, stride_oh,
    num_tokens, num_programs,
    HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, ROTATE_OUT: tl.constexpr,
    LOG2_HEAD_DIM: tl.constexpr, SQRT_HEAD_DIM: tl.constexpr, MIN_STEPS: tl.constexpr, SLOTS: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    """One program per (query token, query head): its pair's partial states, found from the lengths (the module's
    docstring), merged into out; ROTATE_OUT as `split_k.reduce_splits_kernel` (TurboQuant's values accumulate
    rotated). A pair without keys gets zeros. PDL: launched as a programmatic dependent of the decode kernel."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    token = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    total, before = steps_before(seq_lens_ptr, num_tokens, token, BLOCK)
    s = tl.cdiv(tl.load(seq_lens_ptr + token), 16)
    chunk = stream_chunk(total * HEADS, num_programs, MIN_STEPS)
    a = before * HEADS + kv_head * s
    pair = token * HEADS + kv_head
    first = a // chunk + pair
    n = tl.where(s > 0, (a + s - 1) // chunk + pair - first + 1, 0)
    offs_s = tl.arange(0, SLOTS)
    offs_d = tl.arange(0, HEAD_DIM)
    m = tl.full([1], float("-inf"), tl.float32)
    l = tl.zeros([1], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for base in range(0, n, SLOTS):
        ok = base + offs_s < n
        state = (first + base + offs_s).to(tl.int64) * GROUP + head % GROUP
        m_s = tl.load(part_m_ptr + state, mask=ok, other=float("-inf"))
        l_s = tl.load(part_l_ptr + state, mask=ok, other=0.0)
        part = tl.load(part_out_ptr + state[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(m_s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m - m_safe)
        w = tl.math.exp2(m_s - m_safe)
        l = l * alpha + tl.sum(w * l_s, axis=0)
        acc = acc * alpha + tl.sum(part * w[:, None], axis=0)
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)
    if ROTATE_OUT:
        out = tl.sum(fwht(out[None, :], HEAD_DIM, LOG2_HEAD_DIM), axis=0) * (tl.load(signs_ptr + offs_d) / SQRT_HEAD_DIM)
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


def reduce_stream(out: torch.Tensor, parts, view, meta, num_programs: int, min_steps: int = MIN_STEPS) -> None:
    """Merge a stream-K decode's partial states `parts` (`stream_states`) into out [num_tokens, num_q_heads,
    head_dim], rotating back where the format accumulates values rotated (`view.rotate_out`); `min_steps` as the
    decode kernel was given."""
    from .split_k import dependent_options

    part_out, part_m, part_l = parts
    num_tokens, num_q_heads, head_dim = out.shape
    rotate = bool(view.rotate_out)
    slots = REDUCE_SLOTS[0] if 2 * num_tokens * view.num_kv_heads >= num_programs else REDUCE_SLOTS[1]
    assert head_dim == 1 << (head_dim.bit_length() - 1), f"the stream-K reduce needs a power-of-two head_dim, got {head_dim}"
    reduce_stream_kernel[(num_tokens, num_q_heads)](
        out, part_out, part_m, part_l, view.aux("value_signs") if rotate else part_m, meta.seq_lens,
        out.stride(0), out.stride(1), num_tokens, num_programs,
        HEADS=view.num_kv_heads, GROUP=num_q_heads // view.num_kv_heads, HEAD_DIM=head_dim, ROTATE_OUT=rotate,
        LOG2_HEAD_DIM=head_dim.bit_length() - 1, SQRT_HEAD_DIM=math.sqrt(head_dim), MIN_STEPS=min_steps,
        SLOTS=slots, BLOCK=SCAN_BLOCK.value, num_warps=1 if slots * head_dim <= 2048 else 4, **dependent_options(out.device))
