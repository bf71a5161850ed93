"""Random paged batches for the kernel tests: shuffled block tables, lengths off the block size,
decode tokens and prefill chunks in one batch."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from pagedkv.config import KVFormat
from pagedkv.formats import make_format
from pagedkv.ops import reference
from pagedkv.ops.metadata import AttentionMetadata

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class Case:
    fmt: object
    pages: dict
    meta: AttentionMetadata          # attention over the batch (queries = each sequence's new tokens)
    query: torch.Tensor              # [num_tokens, num_q_heads, head_dim]
    keys: torch.Tensor               # [sum(seq_lens), num_kv_heads, head_dim], all positions in sequence order
    values: torch.Tensor
    write_meta: AttentionMetadata    # slots of every position of every sequence, in the same order


def slot_of(table: list[int], pos: int, block_size: int) -> int:
    return table[pos // block_size] * block_size + pos % block_size


def metadata(block_table, seq_lens, q_lens, slots, block_size) -> AttentionMetadata:
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    return AttentionMetadata(block_table.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                             torch.tensor(qsl, dtype=torch.int32, device=DEVICE), slots.to(DEVICE), None,
                             list(seq_lens), qsl, block_size)


def build_case(seed: int, fmt_spec: str, *, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
               ctx_lens: list[int], new_lens: list[int], dtype=torch.float32, extra_table_cols: int = 0) -> Case:
    """Sequences with `ctx_lens[i]` earlier tokens and `new_lens[i]` new ones, written with the reference."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, new_lens)]
    blocks_per_seq = [max(1, math.ceil(s / block_size)) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, pos = [], 0
    for nb in blocks_per_seq:
        tables.append(ids[pos:pos + nb])
        pos += nb
    block_table = torch.zeros(len(seq_lens), max(blocks_per_seq) + extra_table_cols, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    fmt = make_format(KVFormat.parse(fmt_spec), num_kv_heads, head_dim, dtype, DEVICE)
    pages = fmt.allocate_pages(num_blocks, block_size)
    for p in pages.values():  # unwritten slots must never be read
        p.fill_(float("nan")) if p.dtype.is_floating_point else p.fill_(-1)
    total = sum(seq_lens)
    keys = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    values = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    slots = torch.tensor([slot_of(tables[i], p, block_size) for i, s in enumerate(seq_lens) for p in range(s)],
                         dtype=torch.int64)
    write_meta = metadata(block_table, seq_lens, seq_lens, slots, block_size)
    reference.write_kv(pages, fmt, keys, values, write_meta)
    meta = metadata(block_table, seq_lens, new_lens, torch.empty(0, dtype=torch.int64), block_size)
    query = torch.randn(sum(new_lens), num_q_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    return Case(fmt, pages, meta, query, keys, values, write_meta)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in the kernel's output"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def specialization(value, specialize: bool = True) -> tuple:
    """(type, value class) Triton's compile cache keys a non-constexpr argument on: ints == 1 / multiples of 16
    (unless `do_not_specialize`), pointers' 16-byte alignment ("D": divisible by 16)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    return native_specialize_impl(BaseBackend, value, False, specialize, True)


def launch_keys(monkeypatch) -> dict[str, list[tuple]]:
    """Every interpreted kernel launch from now on, by kernel name: what Triton's compile cache would key it on
    (constexpr values; each other argument's `specialization`)."""
    import inspect

    from triton.runtime import interpreter

    keys: dict[str, list[tuple]] = {}
    real = interpreter.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        bound = dict(zip(self.arg_names, args), **kwargs)
        plain = set(self.kwargs.get("do_not_specialize") or ())
        key = []
        for name, param in inspect.signature(self.fn).parameters.items():
            value = bound.get(name)
            if "constexpr" in str(param.annotation):
                key.append((name, str(value)))
            elif isinstance(value, (torch.Tensor, int, float)):
                key.append((name, specialization(value, name not in plain)))
        keys.setdefault(self.fn.__name__, []).append(tuple(key))
        return real(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", run)
    return keys
