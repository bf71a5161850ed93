"""The decode kernels (`ops/triton/decode.py`, both orientations) over a dense recent window: the blocks from each
sequence's first ring block on read from its ring, the ones before from the pages, in one pass, against the
reference path reading the same ring (`reference.window_kv`).

Run compiled on CUDA, else under the Triton interpreter (conftest.py).
"""

import dataclasses

import pytest
import torch

from pagedkv.ops import reference
from pagedkv.ops.metadata import WindowPlan
from pagedkv.ops.triton import decode
from pagedkv.ops.triton.tuning import warp_split_tiles
from triton_cases import DEVICE, build_case, rel_err

BS, NUM_RING_BLOCKS = 16, 4
# a decode token of each sequence (one verify-like run of 3); the first block read from the ring: 0 (all of it),
# in the middle, past the last block (none of it)
CTX_LENS = [199, 37, 70, 20, 8]
NEW_LENS = [1, 1, 3, 1, 1]
FIRST_BLOCKS = [10, 1, 3, 2, 0]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def window_case(spec, num_q_heads, num_kv_heads, head_dim, dtype=torch.float32, seed=0, ctx_lens=CTX_LENS,
                new_lens=NEW_LENS, first_blocks=FIRST_BLOCKS, num_ring_blocks=NUM_RING_BLOCKS):
    """A batch (`triton_cases.build_case`) with its rings: rows shuffled, slots it does not read NaN."""
    case = build_case(seed, spec, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      block_size=BS, ctx_lens=ctx_lens, new_lens=new_lens, dtype=dtype)
    num_seqs = len(ctx_lens)
    rows = torch.randperm(num_seqs + 2, generator=torch.Generator().manual_seed(seed))[:num_seqs].tolist()
    shape = (num_seqs + 2, num_ring_blocks, BS, num_kv_heads, head_dim)
    rings = (torch.full(shape, float("nan"), dtype=dtype, device=DEVICE),
             torch.full(shape, float("nan"), dtype=dtype, device=DEVICE))
    start = 0
    for row, first, length in zip(rows, first_blocks, case.meta.seq_lens_cpu):
        assert -(-length // BS) - first <= num_ring_blocks
        for pos in range(first * BS, length):
            rings[0][row, pos // BS % num_ring_blocks, pos % BS] = case.keys[start + pos]
            rings[1][row, pos // BS % num_ring_blocks, pos % BS] = case.values[start + pos]
        start += length
    per_seq = torch.tensor([rows, first_blocks], dtype=torch.int32, device=DEVICE)
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    meta = dataclasses.replace(case.meta, window=WindowPlan(empty, empty, per_seq[0], per_seq[1], rows, first_blocks,
                                                            num_ring_blocks))
    return dataclasses.replace(case, meta=meta), rings


def window_reference(case, rings, **options):
    def sequence_kv(i):
        if case.meta.window.first_block_cpu[i] * BS >= case.meta.seq_lens_cpu[i]:
            return None
        return reference.window_kv(case.pages, case.fmt, case.meta, i, rings)

    return reference.paged_attention(case.query, case.pages, case.fmt, case.meta, sequence_kv=sequence_kv, **options)


def tiles_of(fmt, transposed):
    return dataclasses.replace(warp_split_tiles(fmt), transposed=transposed)


# (spec, head_dim, orientations): TurboQuant decode reads head_dim 128; q4_0 keys and 4-bit values transposed only
CASES = [("off", 64, (False, True)), ("q8", 64, (False, True)), ("q4", 64, (False, True)),
         ("q4:rotate_keys", 64, (False, True)),
         ("turboquant", 128, (False, True)), ("turboquant:k=q4_0,v=q4_0", 128, (True,)),
         ("turboquant:k=q4_0,v=q4_0,rotate_keys", 128, (True,))]
PARAMS = [(spec, d, t) for spec, d, ts in CASES for t in ts]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("heads", [(2, 2), (8, 2)], ids=["gqa1", "gqa4"])
@pytest.mark.parametrize("spec,head_dim,transposed", PARAMS,
                         ids=[f"{s}-{'keys_m' if t else 'heads_m'}" for s, _, t in PARAMS])
def test_decode_kernels_read_the_pages_then_the_ring(spec, head_dim, transposed, heads, num_splits):
    case, rings = window_case(spec, *heads, head_dim, seed=len(spec) + heads[0])
    ref = window_reference(case, rings, scale=0.2)
    out = decode.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=0.2, num_splits=num_splits,
                                 tiles=tiles_of(case.fmt, transposed), window=rings)
    assert rel_err(out, ref) < TOL[torch.float32]
    plain = decode.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=0.2, num_splits=num_splits,
                                   tiles=tiles_of(case.fmt, transposed))
    if spec != "off":   # the ring's exact keys are what changed the output
        assert rel_err(plain, ref) > 10 * TOL[torch.float32]


@pytest.mark.parametrize("options", [dict(sliding_window=40), dict(softcap=2.0)], ids=["window", "softcap"])
@pytest.mark.parametrize("spec", ["q4", "turboquant"])
def test_decode_kernel_over_the_ring_with_sliding_window_and_softcap(spec, options):
    case, rings = window_case(spec, 8, 2, 128 if spec == "turboquant" else 64, seed=3)
    ref = window_reference(case, rings, scale=0.2, **options)
    out = decode.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=0.2, num_splits=2, window=rings,
                                 **options)
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("spec", ["q4", "q4:rotate_keys", "turboquant"])
def test_decode_kernel_over_the_ring_with_16_bit_queries(spec):
    case, rings = window_case(spec, 8, 2, 128, dtype=torch.float16, seed=5)
    ref = window_reference(case, rings, scale=0.1)
    out = decode.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=0.1, num_splits=2, window=rings)
    assert out.dtype == torch.float16
    assert rel_err(out, ref) < TOL[torch.float16]


def window_steps(spec: str, seed: int):
    """A cache over `spec` pages holding two sequences, and step(counts, also=None): one step of random keys,
    values and queries (4 query heads per KV head) through `cache.attention` on layer 0, fallback warnings
    silenced; `also(q, meta)` runs before the step ends. Returns (cache, seqs, step); step returns
    (meta, q, out, what `also` returned)."""
    import warnings

    from pagedkv import PagedKVCache, ops

    gen = torch.Generator().manual_seed(seed)
    h, d = 2, 128 if spec.startswith("turboquant") else 64
    cache = PagedKVCache(kv_format=spec, block_size=8, num_blocks=64, device=DEVICE)
    seqs = [cache.add_sequence(), cache.add_sequence()]

    def step(counts, also=None):
        meta = cache.begin_step(seqs, counts, device=DEVICE)
        n = sum(counts)
        cache.write(0, *(torch.randn(n, h, d, generator=gen).to(DEVICE) for _ in range(2)), meta)
        q = torch.randn(n, 4 * h, d, generator=gen).to(DEVICE)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ops.PagedKVFallbackWarning)
            out = cache.attention(0, q, scale=0.2, meta=meta)
            extra = also(q, meta) if also else None
        cache.end_forward()
        return meta, q, out, extra

    return cache, seqs, step


@pytest.mark.parametrize("spec", ["q4:recent_tokens=16", "turboquant:recent_tokens=16"])
def test_decode_steps_over_a_window_run_the_triton_kernel_and_prefill_dense_scratch(monkeypatch, spec):
    """Through the cache: prefill with a window runs through dense scratch pages (`dense_prefill`, its own tests
    check its output), decode steps, whose ring blocks move on as the sequences cross blocks, run the kernel and
    attend what `cache.read` shows; nothing falls back to the reference path."""
    from pagedkv import ops

    if DEVICE.type != "cuda":   # the kernels under the interpreter; the writes as the reference does them
        monkeypatch.setattr(ops, "choose_backend", lambda device, kernels, fmt: ("triton", None))
        monkeypatch.setattr("pagedkv.ops.triton.write_kv", reference.write_kv)
    cache, seqs, step = window_steps(spec, 4)

    step([20, 29])
    for _ in range(10):
        meta, q, out, _ = step([1, 1])
        assert meta.window.first_block_cpu != [0, 0]
        for i, s in enumerate(seqs):
            want = reference.attend(q[i:i + 1], *cache.read(s, 0), scale=0.2, sliding_window=None, softcap=None)
            assert rel_err(out[i:i + 1], want) < TOL[torch.float32]
    stats = cache.paged_stats()
    assert stats["paged_attention_bailouts_by_phase_reason"] == {}
    assert stats["triton_attention_calls"] == 11 and stats["reference_attention_calls"] == 0


@pytest.mark.parametrize("spec", ["q4:recent_tokens=16", "turboquant:recent_tokens=16"])
def test_verify_steps_over_a_window_run_the_triton_kernel(monkeypatch, spec):
    """Steps of up to 16 new tokens per sequence (speculative verification) read the window in the decode
    kernel too, each token up to its own position; the reference path over the same step is the check. The
    first step and one with a chunk of 17 go through dense scratch pages, as prefill does."""
    from pagedkv import ops

    backend = {"name": "triton"}
    monkeypatch.setattr(ops, "choose_backend", lambda device, kernels, fmt: (
        backend["name"], None if backend["name"] == "triton" else "check: the reference path, for comparison"))
    if DEVICE.type != "cuda":
        monkeypatch.setattr("pagedkv.ops.triton.write_kv", reference.write_kv)
    cache, seqs, step = window_steps(spec, 5)

    def on_reference(q, meta):
        backend["name"] = "reference"
        try:
            return cache.attention(0, q, scale=0.2, meta=meta)
        finally:
            backend["name"] = "triton"

    for counts in ([20, 29], [3, 4], [1, 5], [16, 2], [17, 1]):
        _, _, out, want = step(counts, on_reference)
        assert rel_err(out, want) < TOL[torch.float32], counts
    stats = cache.paged_stats()
    fallbacks = {k: v for k, v in stats["paged_attention_bailouts_by_phase_reason"].items() if k.endswith(":recent_tokens")}
    assert fallbacks == {}, stats
    assert stats["triton_attention_calls"] == 5    # the reference calls are the check's own


@pytest.mark.parametrize("spec,head_dim", [("q8", 64), ("q4", 128), ("turboquant", 128)])
def test_the_ring_as_the_last_split_attends_the_whole_window(spec, head_dim):
    """`split_k.reduce_with_window` (how the Gluon decode kernels read a window: their splits stop where the ring
    begins, `ring_partials` attends the ring as one more split): every block from the ring, then merged by
    `reduce_splits` (TurboQuant: the ring's share is added after the pages' shares are rotated back, here none)."""
    from pagedkv.ops.triton.attention import dot_precision
    from pagedkv.ops.triton.page_view import page_view
    from pagedkv.ops.triton.split_k import partial_states, reduce_with_window

    case, rings = window_case(spec, 8, 2, head_dim, seed=5, first_blocks=[0] * len(CTX_LENS), num_ring_blocks=16)
    ref = window_reference(case, rings, scale=0.2)
    view = page_view(case.fmt, case.pages)
    precision = dot_precision(case.query.dtype)
    parts = partial_states(case.query, 1, head_dim)
    out = torch.empty_like(case.query)
    reduce_with_window(out, parts, case.query, view, case.meta, rings, 0.2, precision)
    assert rel_err(out, ref) < TOL[torch.float32]
