"""The TurboQuant value-scale search's pieces (`codecs.nearest_centroid`, `codecs.candidate_errors`) against plain
PyTorch at the values where shortcuts go wrong: exactly on a midpoint (+-t * scale), one float step either side,
+-0, tiny values whose quotient underflows, NaN and infinities; and the codebook symmetry they rely on.

Under the interpreter only: compiled, the search divides and fuses as the GPU does (`codecs.divide`), which plain
PyTorch does not; there the pages it writes are held to the format's guarantees by
tests/triton/test_triton_write.py::test_write_matches_reference.
"""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from pagedkv.formats.codebook import decision_thresholds, lloyd_max_codebook
from pagedkv.ops.triton import codecs
from triton_cases import DEVICE

pytestmark = pytest.mark.skipif(DEVICE.type == "cuda", reason="the interpreter's arithmetic (see the module docstring)")


@triton.jit
def nearest_centroid_kernel(y_ptr, thresholds_ptr, out_ptr, N: tl.constexpr, BITS: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, codecs.nearest_centroid(tl.load(y_ptr + offs), thresholds_ptr, BITS))


@triton.jit
def candidate_errors_kernel(x_ptr, rms_ptr, mult_ptr, thresholds_ptr, codebook_ptr, err_ptr, scale_ptr,
                            G: tl.constexpr, CH: tl.constexpr, BITS: tl.constexpr):
    g = tl.load(x_ptr + tl.arange(0, G)[:, None] * 32 + tl.arange(0, 32)[None, :])
    rms = tl.load(rms_ptr + tl.arange(0, G))
    mult = tl.load(mult_ptr + tl.arange(0, CH))
    err, scale16 = codecs.candidate_errors(codecs.group_pieces(g), rms, mult, thresholds_ptr, codebook_ptr, BITS, False)
    at = tl.arange(0, G)[:, None] * CH + tl.arange(0, CH)[None, :]
    tl.store(err_ptr + at, err)
    tl.store(scale_ptr + at, scale16)


@triton.jit
def search_scales_kernel(x_ptr, thresholds_ptr, codebook_ptr, mult_ptr, scale_ptr, found_ptr, G: tl.constexpr,
                         BITS: tl.constexpr, NUM_MULTIPLIERS: tl.constexpr, CANDIDATES: tl.constexpr):
    g = tl.load(x_ptr + tl.program_id(0) * G * 32 + tl.arange(0, G)[:, None] * 32 + tl.arange(0, 32)[None, :])
    scale16, found = codecs.search_scales(g, thresholds_ptr, codebook_ptr, mult_ptr, BITS, NUM_MULTIPLIERS, CANDIDATES,
                                          False)
    offs = tl.program_id(0) * G + tl.arange(0, G)
    tl.store(scale_ptr + offs, scale16)
    tl.store(found_ptr + offs, found.to(tl.int8))


def tables(bits):
    cb = lloyd_max_codebook(bits)
    return cb, decision_thresholds(cb).contiguous()


def ties(t: torch.Tensor, scale: float) -> torch.Tensor:
    """+-t * scale, one float step either side of each, and +-0 (scale a power of two: the products are exact)."""
    on = torch.cat([t, -t]) * scale
    up = torch.nextafter(on, torch.full_like(on, float("inf")))
    down = torch.nextafter(on, torch.full_like(on, -float("inf")))
    return torch.cat([on, up, down, torch.tensor([0.0, -0.0])])


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5])
def test_nearest_centroid_counts_the_midpoints_below(bits):
    _, t = tables(bits)
    tiny = torch.tensor([1, 2, 3, 0x7FFFFF], dtype=torch.int32).view(torch.float32)          # denormals
    special = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 3.4e38, -3.4e38])
    nan_bits = torch.tensor([-1, 0x7FFFFFFF], dtype=torch.int32).view(torch.float32)        # NaNs, all bits set
    y = torch.cat([ties(t, 1.0), ties(t, 0.25), tiny, -tiny, special, nan_bits, torch.randn(200) * 2])
    n = triton.next_power_of_2(y.numel())
    y = torch.cat([y, torch.zeros(n - y.numel())])
    out = torch.empty(n, dtype=torch.int32)
    nearest_centroid_kernel[(1,)](y, t, out, N=n, BITS=bits)
    want = (t[None, :] < y[:, None]).sum(1).to(torch.int32)     # NaN: below nothing, code 0
    bad = (out != want).nonzero().flatten()
    assert bad.numel() == 0, [(y[i].item(), out[i].item(), want[i].item()) for i in bad[:8]]


def expected_errors(x, rms, mult, cb, t):
    """The errors of `candidate_errors` by plain PyTorch, each candidate on its own: y = x / scale, its code
    (midpoints below y), d = codebook[code] * scale - x; summed as the kernel does: per group, element e's squares
    over the pieces e, e + L, e + 2L, ... (L = 32 / groups) in order, then pairwise from the widest stride down."""
    G = x.shape[0]
    L = 32 // G
    scale16 = (rms[:, None] * mult[None, :]).half()
    s = scale16.float()
    s = torch.where(s > 0, s, torch.ones_like(s))[:, :, None]                   # [G, CH, 1]
    y = x[:, None, :] / s                                                       # [G, CH, 32]
    code = (t[None, None, None, :] < y[..., None]).sum(-1)
    d = cb[code] * s - x[:, None, :]
    sq = (d * d).reshape(G, -1, G, L)                                           # [G, CH, piece, e]
    acc = sq[:, :, 0] + sq[:, :, 1]
    for r in range(2, G):
        acc = acc + sq[:, :, r]
    while acc.shape[-1] > 1:
        h = acc.shape[-1] // 2
        acc = acc[..., :h] + acc[..., h:]
    return acc[..., 0], scale16


def midpoint_scale(c0: float) -> float | None:
    """A positive fp16 scale > 2 whose exact product with c0 lies halfway between two float32 values, if any."""
    h = np.arange(0x4000, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)    # 2 <= h < inf
    p = np.float64(c0) * h
    r = p.astype(np.float32).astype(np.float64)
    up = np.nextafter(r.astype(np.float32), np.float32(np.inf)).astype(np.float64)
    down = np.nextafter(r.astype(np.float32), np.float32(-np.inf)).astype(np.float64)
    mid = (r != p) & ((2 * p == r + up) | (2 * p == r + down))
    return float(h[mid][0]) if mid.any() else None


def candidate_case(bits, groups):
    """(x [groups, 32], rms, mult, codebook, midpoints) of `test_candidate_errors_are_the_plain_errors`."""
    cb, t = tables(bits)
    rng = torch.Generator().manual_seed(bits * 10 + groups)
    mult = torch.tensor([1.0, 0.5, 2.0, 4.0, 0.75, 1.25, 8.0, 16.0])
    rms = torch.tensor([1.0, 1.0, 0.0, 0.3, 7.0, 0.01, 1e-4, 300.0])[:groups].clone()
    x = torch.randn(groups, 32, generator=rng)
    tie = ties(t, 1.0)
    tie = tie[torch.randperm(tie.numel(), generator=rng)][:24]
    x[0, :tie.numel()] = tie
    x[0, 24:28] = torch.cat([cb[-2:], -cb[:2]])
    x[0, 28:30] = torch.tensor([0.0, -0.0])
    tiny = torch.tensor([1, 2, 5, 1000, 0x7FFFFF], dtype=torch.int32).view(torch.float32)
    x[1, :5], x[1, 5:10] = tiny, -tiny
    x[1, 10:12] = torch.tensor([0.0, -0.0])
    mid = midpoint_scale(float(cb[(1 << (bits - 1))]))
    if mid is not None:
        rms[1] = mid                      # candidate 0 of group 1 scales by `mid`; 1 * 2**-149 / mid underflows
    if groups > 2:
        x[2] = 0.0
    return x.contiguous(), rms, mult, cb, t


@pytest.mark.parametrize("groups", [2, 4, 8])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_candidate_errors_are_the_plain_errors(bits, groups):
    """Bit for bit, at ties: group 0 holds +-t * scale (and the neighbours) for the scale of candidate 0, +-0 and
    centroids (error 0 there); group 1 tiny values (denormals: their quotients underflow to +-0 for the larger
    scales) among ordinary ones; group 2 is all zero (scale 0 -> 1); group 3 random. Where the codebook has one,
    a scale whose exact product with the smallest positive centroid is a float32 rounding midpoint is a
    candidate: there a tiny positive value's sign decides the last bit of its error."""
    x, rms, mult, cb, t = candidate_case(bits, groups)
    err = torch.empty(groups, mult.numel())
    scale = torch.empty(groups, mult.numel(), dtype=torch.float16)
    candidate_errors_kernel[(1,)](x, rms, mult, t, cb, err, scale, G=groups, CH=mult.numel(), BITS=bits)
    want_err, want_scale = expected_errors(x, rms, mult, cb, t)
    assert torch.equal(scale, want_scale)
    same = err.view(torch.int32) == want_err.view(torch.int32)
    assert bool(same.all()), (err[~same], want_err[~same])


@pytest.mark.parametrize("candidates", [8, 4])
@pytest.mark.parametrize("bits", [3, 4])
def test_search_scales_finds_the_first_least_error(bits, candidates):
    """`search_scales` over the format's 33 candidate scales (full tiles, then a tile for the rest): per group the
    first candidate of least error, as plain PyTorch finds it: ties, tiny values, groups whose best scale is the last
    candidate (the tail tile), an all-zero group (scale 0 -> 1) and a group of NaNs (no finite error: not found,
    scale 0)."""
    from pagedkv.formats.turboquant import SCALE_GRID

    cb, t = tables(bits)
    grid = torch.tensor(SCALE_GRID)
    rows = []
    for seed in range(6):
        x, _, _, _, _ = candidate_case(bits, 4)
        if seed >= 2:
            x = torch.randn(4, 32, generator=torch.Generator().manual_seed(seed)) * 2.0 ** (seed - 4)
            x[seed % 4, :16] = 0.0
            x[(seed + 1) % 4] = 0.01 * x[(seed + 1) % 4]    # two spikes: the last candidate (in the tail tile) wins
            x[(seed + 1) % 4, :2] = 1.0
        if seed == 5:
            x[1] = float("nan")
        rows.append(x)
    x = torch.stack(rows).contiguous()                                  # [rows, groups, 32]
    n, groups = x.shape[0], x.shape[1]
    scale = torch.empty(n, groups, dtype=torch.float16)
    found = torch.empty(n, groups, dtype=torch.int8)
    search_scales_kernel[(n,)](x, t, cb, grid, scale, found, G=groups, BITS=bits, NUM_MULTIPLIERS=grid.numel(),
                               CANDIDATES=candidates)
    for r in range(n):
        rms = x[r].pow(2).mean(-1).sqrt()
        err, scale16 = expected_errors(x[r], rms, grid, cb, t)         # [groups, 33]
        for gi in range(groups):
            finite = torch.isfinite(err[gi])
            if not finite.any():
                assert found[r, gi] == 0 and scale[r, gi].item() == 0.0, (r, gi)
                continue
            best = int(torch.where(finite, err[gi], float("inf")).argmin())   # the first least
            assert found[r, gi] == 1, (r, gi)
            assert scale[r, gi].view(torch.int16) == scale16[gi, best].view(torch.int16), \
                (r, gi, best, scale[r, gi].item(), scale16[gi, best].item())


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_the_codebooks_are_exactly_symmetric(bits):
    """`codecs.half_search` (codes and centroids from the positive half of the codebook) needs c_i == -c_{N-1-i}
    and hence t_i == -t_{N-2-i}, the middle midpoint exactly 0."""
    cb, t = tables(bits)
    assert torch.equal(cb, -cb.flip(0))
    assert torch.equal(t, -t.flip(0))
    assert t[(1 << (bits - 1)) - 1].item() == 0.0
    assert bool((cb[1:] > cb[:-1]).all())
