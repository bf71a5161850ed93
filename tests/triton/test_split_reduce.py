"""`split_k.reduce_splits`: the merge of the splits' partial states, and the rotation back (the values'
Walsh-Hadamard rotation, `hadamard.unrotate`) for formats whose values accumulate in a rotated domain, against
the same in PyTorch."""

from types import SimpleNamespace

import pytest
import torch

from pagedkv.formats.hadamard import random_signs, unrotate
from pagedkv.ops.triton.split_k import reduce_splits


@pytest.mark.parametrize("plain_last", [False, True], ids=["all_rotated", "window_plain"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "rotated"])
def test_reduce_splits_merges_the_partial_states_and_rotates_back(rotate, d, plain_last):
    """`plain_last`: the last slot (a dense window's) is already in the output's domain, so only the others
    rotate."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    tokens, heads, splits = 3, 16, 5
    part_out = torch.randn(tokens, heads, splits, d, generator=gen)
    part_m = torch.randn(tokens, heads, splits, generator=gen)
    part_l = torch.rand(tokens, heads, splits, generator=gen) + 0.5
    part_m[0, 0, 1], part_l[0, 0, 1] = float("-inf"), 0.0   # a split that saw no key
    signs = random_signs(d, 7)
    on_dev = signs.to(dev)
    view = SimpleNamespace(rotate_out=rotate, aux=lambda name: on_dev if name == "value_signs" else None)
    out = torch.zeros(tokens, 2 * heads, d, dtype=torch.bfloat16, device=dev)[:, ::2]   # strided rows
    reduce_splits(out, tuple(t.to(dev) for t in (part_out, part_m, part_l)), view, plain_last=plain_last)
    out = out.cpu()
    w = torch.exp2(part_m - part_m.amax(-1, keepdim=True))
    shares = part_out * (w / (w * part_l).sum(-1, keepdim=True))[..., None]   # [tokens, heads, splits, d]
    if rotate and plain_last:
        want = unrotate(shares[:, :, :-1].sum(2), signs) + shares[:, :, -1]
    else:
        want = unrotate(shares.sum(2), signs) if rotate else shares.sum(2)
    assert torch.allclose(out.float(), want, atol=1e-2, rtol=1e-2), (out.float() - want).abs().max()
