"""A decode step's launch order, longest sequence first (`metadata.LONGEST_FIRST`, on by default): the planners'
token order, the Gluon kernels' grid over it (`decode_gluon.launch_grid`), the split count it asks for, and the
CUDA graph runner's static order row, refilled each step (on the CPU; the kernels' outputs under it are checked on
the GPU in tests/triton/test_decode_gluon.py)."""

import dataclasses

import numpy as np
import pytest
import torch

import pagedkv.ops
import pagedkv.ops.triton
from pagedkv.ops import metadata
from pagedkv.ops.metadata import AttentionMetadata
from pagedkv.ops.triton import decode_gluon, tuning
from test_engine_cuda_graph import _tensor_driven_attention, graph_llm, requests, tiny_llama
from test_engine_cuda_graph import tensor_driven_kernels  # noqa: F401  (a fixture)


def test_tokens_are_ordered_longest_span_first():
    assert metadata.longest_first([5, 9, 9, 2], 1).tolist() == [1, 2, 0, 3]   # ties keep their order
    # three new tokens a sequence: the sequence's later tokens attend over more
    assert metadata.longest_first([4, 7], 3).tolist() == [5, 4, 3, 2, 1, 0]
    assert metadata.longest_first([], 1) is None
    assert metadata.longest_first([3], 1).dtype == np.int32


def meta_of(lens, per=1):
    n = len(lens)
    qsl = [i * per for i in range(n + 1)]
    return AttentionMetadata(torch.zeros(n, 4, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                             torch.tensor(qsl, dtype=torch.int32), torch.zeros(n * per, dtype=torch.int64), None,
                             list(lens), qsl, 16)


def test_the_grid_runs_over_the_order_when_there_is_one():
    lens = [30, 50, 10, 50]
    q = torch.empty(4, 8, 128)
    meta = meta_of(lens)
    grid, pointer, ordered = decode_gluon.launch_grid(q, meta, 2, 3, None)
    assert (grid, ordered) == ((4, 2, 3), False) and pointer is meta.seq_lens
    grid, order, ordered = decode_gluon.launch_grid(q, meta, 2, 3, True)   # computed on the device
    assert (grid, ordered) == ((2, 3, 4), True) and order.tolist() == [1, 3, 0, 2]   # (heads, splits, tokens)
    given = dataclasses.replace(meta, token_order=torch.tensor([3, 1, 0, 2], dtype=torch.int32))
    grid, order, ordered = decode_gluon.launch_grid(q, given, 2, 3, None)
    assert ordered and order is given.token_order
    assert decode_gluon.launch_grid(q, given, 2, 3, False)[2] is False
    many = dataclasses.replace(meta_of([5] * 4), token_order=torch.arange(4, dtype=torch.int32))
    assert decode_gluon.launch_grid(torch.empty(70000, 8, 128), many, 1, 1, True)[2] is False   # past CUDA's grid z
    two = meta_of([9, 12], per=2)   # verify steps: a sequence's tokens together, its last first
    assert decode_gluon.launch_grid(torch.empty(4, 8, 128), two, 1, 1, True)[1].tolist() == [3, 2, 1, 0]
    ragged = AttentionMetadata(meta.block_table[:2], meta.seq_lens[:2], torch.tensor([0, 1, 3], dtype=torch.int32),
                               torch.zeros(3, dtype=torch.int64), None, lens[:2], [0, 1, 3], 16)
    with pytest.raises(ValueError, match="equally many query tokens"):
        decode_gluon.launch_grid(torch.empty(3, 8, 128), ragged, 1, 1, True)


def test_longest_first_asks_for_more_programs_than_slots(monkeypatch):
    monkeypatch.setattr(tuning, "multiprocessor_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    # 1,024 programs on 8 x 132 slots: one split in grid order; longest first, enough for 1.5 waves
    assert tuning.warp_split_splits(1024, 8192, cuda, 8) == 1
    assert tuning.warp_split_splits(1024, 8192, cuda, 8, ordered=True) == 2
    assert tuning.warp_split_splits(1024, 128, cuda, 8, ordered=True) == 1   # no more than the keys allow
    # programs that leave slots free split as before
    assert tuning.warp_split_splits(256, 8192, cuda, 8, ordered=True) == tuning.warp_split_splits(256, 8192, cuda, 8) == 4


def test_longest_first_keeps_out_of_a_short_second_wave(monkeypatch):
    monkeypatch.setattr(tuning, "multiprocessor_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    # q4 at batch 144 (1,152 programs, 8 KV heads): 1.5 waves of 8 slots ask for 2 splits, 2,304 programs, just past
    # the 16 x 132 = 2,112 the multiprocessors hold: one split more
    assert tuning.warp_split_splits(1152, 8192, cuda, 8, ordered=True) == 2
    assert tuning.warp_split_splits(1152, 8192, cuda, 8, ordered=True, resident_per_sm=16) == 3
    assert tuning.warp_split_splits(1280, 8192, cuda, 8, ordered=True, resident_per_sm=16) == 3   # 1.21 waves
    # exactly one full wave, or well past it, stays; so do grid order and the keys' limit
    assert tuning.warp_split_splits(1024, 8192, cuda, 8, ordered=True, resident_per_sm=16) == 2   # 2,048 programs
    assert tuning.warp_split_splits(1056, 8192, cuda, 8, ordered=True, resident_per_sm=16) == 2   # 2,112: one wave
    assert tuning.warp_split_splits(1152, 8192, cuda, 8, resident_per_sm=16) == 1
    assert tuning.warp_split_splits(1152, 256, cuda, 8, ordered=True, resident_per_sm=16) == 2    # 128 keys a split
    # where the split rule aims at the resident programs themselves (TurboQuant), 1.5 waves never end in the band
    for programs in range(1, 3000):
        assert tuning.warp_split_splits(programs, 65536, cuda, 12, ordered=True) == \
            tuning.warp_split_splits(programs, 65536, cuda, 12, ordered=True, resident_per_sm=12), programs


def test_the_resident_programs_table_covers_the_served_gluon_kernels():
    from pagedkv.config import KVFormat

    def resident(spec, head_dim=128):
        return decode_gluon.resident_programs(KVFormat.parse(spec), head_dim)

    assert [resident(s) for s in ("q8", "q6", "q4", "turboquant", "turboquant:k=q4_0,v=q4_0")] == [16, 16, 16, 16, 12]
    assert resident("off") is None and resident("q8", 64) is None and resident("turboquant:k=q8_0,v=q4_0") is None


def test_the_graph_runner_refills_the_order_each_step(tensor_driven_kernels, monkeypatch):  # noqa: F811
    monkeypatch.setattr(metadata, "LONGEST_FIRST", True)
    seen = []

    def attention(query, pages, fmt, meta, **kwargs):
        if meta.token_order is not None:
            lens = meta.seq_lens.tolist()
            seen.append(meta.token_order.tolist() == metadata.longest_first(lens, 1).tolist())
        return _tensor_driven_attention(query, pages, fmt, meta, **kwargs)

    monkeypatch.setattr(pagedkv.ops.triton, "paged_attention", attention)
    model = tiny_llama()
    prompts, params = requests()
    options = dict(num_blocks=64, block_size=4)
    eager = pagedkv.LLM(model, enforce_eager=True, max_num_seqs=4, **options).generate(prompts, params)
    llm = graph_llm(model, **options)
    assert llm.engine.runner.graphs.ordered
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in eager]
    assert len(seen) > 20 and all(seen)


def test_the_cache_orders_decode_and_verify_steps_only(monkeypatch):
    from pagedkv.cache import PagedKVCache

    order = PagedKVCache._token_order
    assert metadata.LONGEST_FIRST   # on by default
    monkeypatch.setattr(metadata, "LONGEST_FIRST", False)
    assert order([30, 50], [1, 1], None, "cuda") is None   # turned off: grid order
    monkeypatch.setattr(metadata, "LONGEST_FIRST", True)
    assert order([30, 50], [1, 1], None, "cpu") is None   # the CPU's reference path has no launch order
    assert order([1024, 1024], [1024, 1024], None, "cuda") is None   # prefill chunks: no decode kernel reads it
    assert order([30, 50], [1, 2], None, "cuda") is None   # unequal new tokens


def test_a_mixed_steps_decodes_launch_in_the_order_decode_steps_do(monkeypatch):
    """Quantized pages split a mixed step: its decodes run the decode kernels over their own metadata (`part`). They
    launch longest first as decode steps do, so they use the kernel variants the CUDA graphs compiled (in grid order
    a q4 engine compiled another variant mid-stream: a 0.9 s step on an H200); its prefill chunks get no order."""
    from pagedkv.ops.triton import dense_prefill

    calls = []

    def order(seq_lens, num_new_tokens, device):
        calls.append((list(seq_lens), list(num_new_tokens)))
        return torch.tensor(metadata.longest_first(seq_lens, num_new_tokens[0])) if len(set(num_new_tokens)) == 1 else None

    monkeypatch.setattr(metadata, "launch_order", order)
    lens, new = [30, 50, 40, 64, 96], [1, 1, 1, 64, 32]
    qsl = [0]
    for n in new:
        qsl.append(qsl[-1] + n)
    meta = metadata.AttentionMetadata(torch.zeros(5, 8, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                                      torch.tensor(qsl, dtype=torch.int32), torch.zeros(qsl[-1], dtype=torch.int64),
                                      None, lens, qsl, 16)
    decodes, chunks = dense_prefill.part(meta, 0, 3), dense_prefill.part(meta, 3, 5)
    assert calls == [([30, 50, 40], [1, 1, 1]), ([64, 96], [64, 32])]
    assert decodes.token_order.tolist() == [1, 2, 0] and chunks.token_order is None
