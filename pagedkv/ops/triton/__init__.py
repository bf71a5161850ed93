"""Triton kernels for CUDA tensors. `supports` says whether they can run for a device and format."""

from __future__ import annotations

import torch


def supports(device: torch.device, fmt) -> tuple[bool, str | None]:
    if torch.device(device).type != "cuda":
        return False, "cpu_device: tensors are not on a CUDA device"
    try:
        import triton  # noqa: F401
    except ImportError:
        return False, "no_triton: the triton package is not installed"
    return False, "no_kernel: no Triton kernel is built for this format yet"
