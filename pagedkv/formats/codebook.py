"""Lloyd–Max codebooks for a standard normal variable (the TurboQuant value codes)."""

from __future__ import annotations

import math
from functools import lru_cache

import torch


def _pdf(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


@lru_cache(maxsize=None)
def _lloyd_max(bits: int) -> tuple[float, ...]:
    levels = 1 << bits
    # start from the high-resolution optimum (point density ~ pdf^(1/3), i.e. quantiles of N(0, 3))
    p = (torch.arange(levels, dtype=torch.float64) + 0.5) / levels
    c = math.sqrt(3.0) * torch.special.ndtri(p)
    for _ in range(20000):
        t = decision_thresholds(c)
        lo = torch.cat([torch.tensor([-math.inf], dtype=torch.float64), t])
        hi = torch.cat([t, torch.tensor([math.inf], dtype=torch.float64)])
        mass = torch.special.ndtr(hi) - torch.special.ndtr(lo)
        new = (_pdf(lo) - _pdf(hi)) / mass  # E[x | lo < x < hi]
        done = float((new - c).abs().max()) < 1e-12
        c = new
        if done:
            break
    c = (c - c.flip(0)) / 2  # exact symmetry
    return tuple(c.tolist())


def lloyd_max_codebook(bits: int) -> torch.Tensor:
    """The 2**bits centroids (ascending, float32) minimising E[(x - q(x))^2] for x ~ N(0, 1)."""
    assert 1 <= bits <= 8, f"no codebook of {bits} bits"
    return torch.tensor(_lloyd_max(bits), dtype=torch.float32)


def decision_thresholds(codebook: torch.Tensor) -> torch.Tensor:
    """The midpoints between neighbouring centroids (codebook ascending): code i covers (t[i-1], t[i]]."""
    return (codebook[1:] + codebook[:-1]) / 2


def nearest_centroid(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the nearest centroid of each element of x (float32); codebook ascending. -> int64, x's shape."""
    return torch.bucketize(x, decision_thresholds(codebook).to(x.device))
