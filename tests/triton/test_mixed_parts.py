"""A mixed step laid out for a CUDA graph (`AttentionMetadata.parts`): decode rows through the decode kernels, then
prefill chunks through the fused varlen kernel, from device metadata alone (host lists are placeholders, as in a
capture), with padding after the chunks: every real row matches the reference path over the plain batch."""

import pytest
import torch

from pagedkv.ops import reference
from pagedkv.ops import triton as triton_ops
from pagedkv.ops.metadata import AttentionMetadata
from triton_cases import DEVICE, build_case, rel_err

SPECS = ["off", "q8", "q4", "turboquant", "turboquant:k=q4_0,v=q4_0"]
# three decodes, a chunk of 9 after 30 tokens, a first chunk of 5, and a padding sequence (no tokens, no context)
CTX_LENS, NEW_LENS = [40, 17, 70, 30, 0, 0], [1, 1, 1, 9, 5, 0]
NUM_DECODES, CHUNK_ROWS = 3, 20   # 14 chunk tokens padded to 20 rows


def device_part(meta: AttentionMetadata, lo: int, hi: int, q_lens: list[int]) -> AttentionMetadata:
    """Sequences lo..hi-1 with their own query offsets; host lists as a capture would hold them (placeholders)."""
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    capacity = meta.block_table.shape[1] * meta.block_size
    return AttentionMetadata(meta.block_table[lo:hi].contiguous(), meta.seq_lens[lo:hi].contiguous(),
                             torch.tensor(qsl, dtype=torch.int32, device=DEVICE), meta.slot_mapping, None,
                             [capacity] * (hi - lo), [0] * (hi - lo + 1), meta.block_size)


@pytest.mark.parametrize("spec", SPECS)
def test_mixed_parts_match_reference(spec):
    case = build_case(11, spec, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                      ctx_lens=CTX_LENS, new_lens=NEW_LENS)
    scale = 64 ** -0.5
    ref = reference.paged_attention(case.query, case.pages, case.fmt, case.meta, scale=scale)
    real = sum(NEW_LENS)
    padding = torch.randn(NUM_DECODES + CHUNK_ROWS - real, *case.query.shape[1:], dtype=case.query.dtype,
                          device=DEVICE)
    query = torch.cat([case.query, padding])
    decodes = device_part(case.meta, 0, NUM_DECODES, NEW_LENS[:NUM_DECODES])
    chunks = device_part(case.meta, NUM_DECODES, len(NEW_LENS), NEW_LENS[NUM_DECODES:])
    whole = AttentionMetadata(case.meta.block_table, case.meta.seq_lens, case.meta.query_start_loc,
                              case.meta.slot_mapping, None, case.meta.seq_lens_cpu, case.meta.query_start_loc_cpu,
                              case.meta.block_size, parts=(decodes, chunks))
    out = triton_ops.paged_attention(query, case.pages, case.fmt, whole, scale=scale)
    assert out.shape == query.shape
    tol = 1e-5 if spec == "off" else 2e-3
    assert rel_err(out[:NUM_DECODES], ref[:NUM_DECODES]) < tol
    assert rel_err(out[NUM_DECODES:real], ref[NUM_DECODES:real]) < tol
