"""Device identity: `torch.device("cuda")` names the current CUDA device, which tensors report as `cuda:N`.

A cache built with `device="cuda"` allocates its pages on the current device, and the keys a model on
that device writes say `cuda:0` (or `cuda:N`): the two are the same device, and comparing them as
`torch.device` values would say otherwise. Every such comparison goes through `same_device`.
"""

from __future__ import annotations

from typing import Callable

import torch


def _current_index(device_type: str) -> int:
    if device_type == "cuda":
        return torch.cuda.current_device()
    module = getattr(torch, device_type, None)
    current = getattr(module, "current_device", None)
    return current() if callable(current) else 0


def concrete_device(device: "str | torch.device", current_index: Callable[[str], int] = _current_index) -> torch.device:
    """`device` with its index filled in: "cuda" -> cuda:<current device>; the CPU, meta and indexed devices as given.

    `current_index(device_type)` gives the current device index of a device type (default: torch's own).
    """
    device = torch.device(device)
    if device.index is not None or device.type in ("cpu", "meta"):
        return device
    return torch.device(device.type, current_index(device.type))


def same_device(a: "str | torch.device", b: "str | torch.device",
                current_index: Callable[[str], int] = _current_index) -> bool:
    """Whether `a` and `b` name one device once an index-less accelerator stands for the current one."""
    a, b = torch.device(a), torch.device(b)
    if a == b:
        return True
    if a.type != b.type:
        return False
    return concrete_device(a, current_index) == concrete_device(b, current_index)
