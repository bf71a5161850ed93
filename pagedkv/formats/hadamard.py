"""The randomized Hadamard rotation used by TurboQuant (values, and keys with `rotate_keys`) and by
KV-Quant `rotate_keys`: R x = H (s * x) / sqrt(n).

H is the Sylvester Hadamard matrix of order n (a power of two), s a fixed vector of +-1 signs drawn from
a seeded generator, so R is orthogonal and the same in every process: R^T y = s * (H y) / sqrt(n).
"""

from __future__ import annotations

import math

import torch

VALUE_SEED = 0x7A3B  # sign seeds: values and (with rotate_keys) keys use independent rotations
KEY_SEED = 0x51C2


def random_signs(n: int, seed: int) -> torch.Tensor:
    """[n] float32 of +-1, the same for a given (n, seed) on every machine."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=gen).float() * 2 - 1


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised fast Walsh–Hadamard transform along the last dim (a power of two): H x."""
    n = x.shape[-1]
    assert n & (n - 1) == 0, f"the Hadamard transform needs a power-of-two length, got {n}"
    lead = x.shape[:-1]
    h = 1
    while h < n:
        y = x.reshape(*lead, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, n)
        h *= 2
    return x


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """R x along the last dim; x float, signs [n]."""
    return fwht(x * signs) / math.sqrt(x.shape[-1])


def unrotate(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """R^T y along the last dim (the inverse of `rotate`)."""
    return fwht(y) * signs / math.sqrt(y.shape[-1])


def rotation_matrix(signs: torch.Tensor) -> torch.Tensor:
    """[n, n] float32 M with `x @ M == rotate(x, signs)` (and `y @ M.T == unrotate(y, signs)`).

    One matrix product costs a handful of tiny tensor operations where the butterflies cost dozens, which
    is what a single decode token pays for; kernels read the same matrix.
    """
    n = signs.shape[0]
    return rotate(torch.eye(n, dtype=torch.float32, device=signs.device), signs.float())


def key_rotation(head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation of keys before quantization (`rotate_keys`, TurboQuant and KV-Quant alike): signs [n]
    float32 +-1 from KEY_SEED and their `rotation_matrix` [n, n] float32, on `device`. Attention rotates
    queries by the same matrix, so q . k is unchanged (the rotation is orthogonal)."""
    signs = random_signs(head_dim, KEY_SEED).to(device)
    return signs, rotation_matrix(signs)


def rotate_with(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """x @ matrix, in float32, or in float64 for float64 x (where a float32 product's rounding, which depends on
    how many rows one matrix product holds, could move a code between a verify and a decode step)."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return x.to(dtype) @ matrix.to(dtype)
