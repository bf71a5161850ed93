"""A decode step (cache write + paged attention) captured once in a CUDA graph and replayed with new
metadata matches eager execution, for every page format and both attention variants."""

import random

import pytest
import torch

from pagedkv.config import KVFormat
from pagedkv.formats import make_format
from pagedkv.ops import reference
from pagedkv.ops import triton as triton_ops
from pagedkv.ops.metadata import AttentionMetadata
from triton_cases import rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

FORMATS = ["off", "q8", "q6", "q4", "turboquant", "turboquant:k=q4_0,v=q4_0,rotate_keys", "turboquant:k=q5_0,v=q2_0"]
NUM_SEQS, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 3, 8, 2, 128, 16


class DecodeStep:
    """Static device tensors of one decode step (fixed capacity), refilled before every replay."""

    def __init__(self, max_blocks: int):
        dev = torch.device("cuda")
        self.block_table = torch.zeros(NUM_SEQS, max_blocks, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(NUM_SEQS, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(NUM_SEQS + 1, dtype=torch.int32, device=dev)
        self.slot_mapping = torch.zeros(NUM_SEQS, dtype=torch.int64, device=dev)
        self.query = torch.zeros(NUM_SEQS, NUM_Q_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)
        self.key = torch.zeros(NUM_SEQS, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)
        self.value = torch.zeros_like(self.key)
        # host copies are placeholders: a captured step must not depend on them
        self.meta = AttentionMetadata(self.block_table, self.seq_lens, self.query_start_loc, self.slot_mapping, None,
                                      [0] * NUM_SEQS, list(range(NUM_SEQS + 1)), BLOCK_SIZE)

    def fill(self, rng: random.Random, num_blocks: int):
        """New lengths, shuffled block tables, new tokens; returns metadata with true host copies."""
        max_blocks = self.block_table.shape[1]
        ids = list(range(num_blocks))
        rng.shuffle(ids)
        lens = [rng.randint(1, max_blocks * BLOCK_SIZE) for _ in range(NUM_SEQS)]
        table = torch.tensor([ids[i * max_blocks:(i + 1) * max_blocks] for i in range(NUM_SEQS)], dtype=torch.int32)
        slots = [int(table[i, (n - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (n - 1) % BLOCK_SIZE for i, n in enumerate(lens)]
        self.block_table.copy_(table)
        self.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        self.slot_mapping.copy_(torch.tensor(slots, dtype=torch.int64))
        self.query.normal_()
        self.key.normal_()
        self.value.normal_()
        return AttentionMetadata(self.block_table, self.seq_lens, self.query_start_loc, self.slot_mapping, None,
                                 lens, list(range(NUM_SEQS + 1)), BLOCK_SIZE)

    def run(self, pages, fmt):
        triton_ops.write_kv(pages, fmt, self.key, self.value, self.meta)
        return triton_ops.paged_attention(self.query, pages, fmt, self.meta, scale=HEAD_DIM ** -0.5)


@pytest.mark.parametrize("max_blocks", [8, 64], ids=["varlen", "split_k"])
@pytest.mark.parametrize("fmt_spec", FORMATS)
def test_decode_step_replays_with_new_metadata(fmt_spec, max_blocks):
    rng = random.Random(0)
    num_blocks = NUM_SEQS * max_blocks
    fmt = make_format(KVFormat.parse(fmt_spec), NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    pages = fmt.allocate_pages(num_blocks, BLOCK_SIZE)
    everything = torch.randn(num_blocks * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    fill = AttentionMetadata(torch.zeros(1, 1, dtype=torch.int32, device="cuda"), torch.zeros(1, dtype=torch.int32, device="cuda"),
                             torch.zeros(2, dtype=torch.int32, device="cuda"),
                             torch.arange(num_blocks * BLOCK_SIZE, device="cuda"), None, [0], [0, 0], BLOCK_SIZE)
    reference.write_kv(pages, fmt, everything, everything.flip(0), fill)  # every slot holds a valid token

    step = DecodeStep(max_blocks)
    step.fill(rng, num_blocks)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        step.run({n: p.clone() for n, p in pages.items()}, fmt)
    torch.cuda.current_stream().wait_stream(stream)
    graph_pages = {n: p.clone() for n, p in pages.items()}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step.run(graph_pages, fmt)

    eager_pages = {n: p.clone() for n, p in pages.items()}
    for _ in range(3):
        torch.cuda.synchronize()
        for n in pages:
            graph_pages[n].copy_(eager_pages[n])
        meta = step.fill(rng, num_blocks)
        graph.replay()
        eager_out = step.run(eager_pages, fmt)
        torch.cuda.synchronize()
        assert torch.equal(graph_out, eager_out)
        for n in pages:
            assert torch.equal(graph_pages[n], eager_pages[n]), n
        ref = reference.paged_attention(step.query, eager_pages, fmt, meta, scale=HEAD_DIM ** -0.5)
        assert rel_err(graph_out, ref) < 2e-2
