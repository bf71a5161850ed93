"""`stream_k`: a decode batch's key steps divided evenly over a fixed grid of programs. The plan covers every
(token, KV head) pair's keys once, in slots no two segments share; the kernels' own device functions walk the
same plan; the reduce finds each pair's partial states from the lengths alone and merges them (rotating back
where the values accumulate rotated) into the attention PyTorch computes; and the tile-language decode kernel runs
the whole path, every format it reads, to the reference's output (the Gluon kernels' are GPU tests,
`test_decode_gluon.py`)."""

import math
import random
from types import SimpleNamespace

import pytest
import torch

from pagedkv.formats.hadamard import random_signs, rotate
from pagedkv.ops.triton import stream_k

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def random_lengths(rng: random.Random, n: int) -> list[int]:
    """Lengths around the 16-key steps' edges, some empty (a graph's padding rows), some long."""
    return [rng.choice([0, 1, 15, 16, 17, 33, rng.randint(1, 3000)]) for _ in range(n)]


@pytest.mark.parametrize("seed", range(40))
def test_the_plan_covers_each_pair_once_in_slots_no_two_segments_share(seed):
    rng = random.Random(seed)
    lens = random_lengths(rng, rng.randint(1, 200))
    heads, programs = rng.choice([1, 2, 8]), rng.choice([1, 3, 7, 64, 500, 2112])
    plan = stream_k.segments(lens, heads, programs)
    steps = [-(-n // 16) for n in lens]
    total = heads * sum(steps)
    chunk = max(stream_k.MIN_STEPS, -(-total // programs))
    covered, slots = {}, set()
    for p, segs in enumerate(plan):
        assert sum(-(-(hi - lo) // 16) for _, _, lo, hi, _ in segs) <= chunk   # a program's share at most
        for t, h, lo, hi, slot in segs:
            assert 0 <= lo < hi <= lens[t] and lo % 16 == 0
            assert slot not in slots and slot < stream_k.num_slots(len(lens), heads, programs)
            slots.add(slot)
            covered.setdefault((t, h), []).append((lo, hi, slot))
    assert set(covered) == {(t, h) for t in range(len(lens)) for h in range(heads) if lens[t]}
    before = 0
    for t, n in enumerate(lens):
        for h in range(heads):
            if not n:
                continue
            ranges = covered[t, h]
            assert [lo for lo, _, _ in ranges] == [0] + [hi for _, hi, _ in ranges[:-1]] and ranges[-1][1] == n
            # the reduce's look-up: the pair's slots run from its first program's to its last's, in order
            a, pair = before * heads + h * steps[t], t * heads + h
            first, last = a // chunk + pair, (a + steps[t] - 1) // chunk + pair
            assert [slot for _, _, slot in ranges] == list(range(first, last + 1))
        before += steps[t]


@pytest.mark.parametrize("seed", range(4))
def test_the_kernels_walk_the_same_plan_on_the_device(seed):
    rng = random.Random(100 + seed)
    lens = random_lengths(rng, [3, 40, 150, 600][seed])   # 600: three vector passes of SCAN_BLOCK
    heads, programs = [(8, 64), (2, 7), (8, 500), (1, 33)][seed]
    plan = stream_k.segments(lens, heads, programs)
    got = stream_k.device_segments(torch.tensor(lens, dtype=torch.int32, device=DEV), heads, programs,
                                   max_segments=max(len(segs) for segs in plan))
    assert got == plan


def partial_state(q, k, v, scale):
    """(out unnormalised, max in log2 units, sum) of one segment: q [G, D], k, v [n, D]."""
    s = (q @ k.T) * scale * math.log2(math.e)                          # [G, n]
    m = s.amax(-1)
    p = torch.exp2(s - m[:, None])
    return p @ v, m, p.sum(-1)


@pytest.mark.parametrize("programs", [11, 40])   # a pair for every two programs or more, and fewer (REDUCE_SLOTS)
@pytest.mark.parametrize("rotated", [False, True], ids=["plain", "rotated"])
@pytest.mark.parametrize("d,heads,group", [(64, 3, 3), (128, 2, 4), (128, 1, 8)])
def test_the_reduce_merges_each_pairs_partial_states_into_its_attention(d, heads, group, rotated, programs):
    gen = torch.Generator().manual_seed(d + heads)
    lens = [40, 0, 1, 300, 17, 129]
    scale = d ** -0.5   # with one step a program at least, pairs of up to 6 and 18 partial states
    q = torch.randn(len(lens), heads * group, d, generator=gen)
    keys = [torch.randn(n, heads, d, generator=gen) for n in lens]
    values = [torch.randn(n, heads, d, generator=gen) for n in lens]
    signs = random_signs(d, 3)
    part_out, part_m, part_l = stream_k.stream_states(q, heads, programs)
    part_m.fill_(float("nan"))   # a slot no segment wrote must not be read
    for segs in stream_k.segments(lens, heads, programs, min_steps=1):
        for t, h, lo, hi, slot in segs:
            qg = q[t, h * group:(h + 1) * group]
            v = values[t][lo:hi, h]
            out, m, l = partial_state(qg, keys[t][lo:hi, h], rotate(v, signs) if rotated else v, scale)
            states = slice(slot * group, (slot + 1) * group)
            part_out[states], part_m[states], part_l[states] = out, m, l
    view = SimpleNamespace(rotate_out=rotated, num_kv_heads=heads,
                           aux=lambda name: signs.to(DEV) if name == "value_signs" else None)
    meta = SimpleNamespace(seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEV))
    out = torch.full((len(lens), heads * group, d), float("nan"), dtype=torch.float32, device=DEV)
    stream_k.reduce_stream(out, tuple(x.to(DEV) for x in (part_out, part_m, part_l)), view, meta, programs,
                           min_steps=1)
    out = out.cpu()
    for t, n in enumerate(lens):
        for h in range(heads):
            qg = q[t, h * group:(h + 1) * group]
            if n == 0:   # no keys: zeros
                assert torch.equal(out[t, h * group:(h + 1) * group], torch.zeros(group, d))
                continue
            want = torch.softmax(qg @ keys[t][:, h].T * scale, -1) @ values[t][:, h]
            assert torch.allclose(out[t, h * group:(h + 1) * group], want, atol=1e-4, rtol=1e-4), (t, h)


# (format, (num_q_heads, num_kv_heads, head_dim, block_size)): every format the transposed decode kernel reads; GQA
# 4 and 8 and head_dim 64 where the format has them
DECODE_CASES = ([(spec, (8, 2, 128, 16)) for spec in ("off", "q8", "q6", "q4", "turboquant", "turboquant:k=q4_0,v=q4_0")]
                + [(spec, (2, 2, 64, 16)) for spec in ("off", "q8")]
                + [(spec, (8, 1, 128, 32)) for spec in ("q4", "turboquant")])


@pytest.mark.parametrize("programs", [3, 50])   # pairs cut in many segments; most programs idle
@pytest.mark.parametrize("spec,shape", DECODE_CASES, ids=lambda c: "q{}kv{}d{}bs{}".format(*c) if isinstance(c, tuple) else c)
def test_the_transposed_decode_kernel_streams_to_the_reference(spec, shape, programs):
    """`decode.paged_attention(..., stream=N)`: the tile-language kernel walks the same plan as the Gluon ones (the
    same `next_segment`), writes its partial states in `stream_states`' slots, and `reduce_stream` merges them."""
    from pagedkv.ops import reference
    from pagedkv.ops.triton import decode
    from triton_cases import build_case, rel_err

    hq, hkv, d, bs = shape
    ctx = [0, 15, 16, 30, 100, 46, 2]   # one new token each: a decode batch
    case = build_case(len(spec) + d, spec, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                      ctx_lens=ctx, new_lens=[1] * len(ctx), dtype=torch.float16)
    assert stream_k.streams(case.query, case.meta, None)
    ref = reference.paged_attention(case.query.float(), case.pages, case.fmt, case.meta, scale=d ** -0.5)
    out = decode.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=d ** -0.5, stream=programs)
    assert rel_err(out, ref) < 2e-3


def test_only_decode_batches_without_a_window_stream_at_power_of_two_head_dims():
    query = torch.empty(3, 4, 128)
    decode = SimpleNamespace(block_table=torch.zeros(3, 2), query_start_loc_cpu=[0, 1, 2, 3])
    assert stream_k.streams(query, decode, None)
    assert not stream_k.streams(query, decode, (query, query))                        # a dense recent window
    assert not stream_k.streams(query, SimpleNamespace(block_table=torch.zeros(3, 2), query_start_loc_cpu=[0, 0, 2, 3]),
                                None)                                                  # a sequence with two
    assert not stream_k.streams(torch.empty(3, 4, 96), decode, None)                  # head_dim 96
