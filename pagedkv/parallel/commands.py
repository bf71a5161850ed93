"""`pagedkv generate --tensor-parallel N`: check the request, start N ranks, answer on rank 0.

Everything a user can get wrong (heads not divisible by N, more ranks than devices, a model without a
tensor-parallel plan, an indexed --device) is checked here, before any rank starts.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch

from ..errors import ConfigError
from .launcher import RankFailed, launch
from .model import check_model, load_sharded_model
from .step import follow, install_sharded_cache, lead


def resolve_parallel_device(device: str, world_size: int) -> str:
    """The device type the ranks run on ("cuda": rank r on cuda:r; "cpu"), from --device."""
    parsed = torch.device(device)
    if parsed.index is not None:
        raise ConfigError(f"--device {device} with --tensor-parallel {world_size}: rank r runs on {parsed.type}:r; "
                          f"pass --device {parsed.type}")
    if parsed.type not in ("cuda", "cpu"):
        raise ConfigError(f"--device {device}: tensor parallelism runs on cuda (NCCL) or cpu (gloo)")
    return parsed.type


def generate_tensor_parallel(args: argparse.Namespace, prompt: str, cache_options: dict) -> int:
    from ..cli import resolve_device_dtype
    from ..models import resolve_model_dir

    device, dtype = resolve_device_dtype(args)
    device_type = resolve_parallel_device(device, args.tensor_parallel)
    folder, gguf = resolve_model_dir(args.model)
    check_model(folder, args.tensor_parallel, device_type)
    try:
        launch(_generate_rank, args.tensor_parallel, device_type, str(folder), gguf, dtype, prompt, cache_options, args)
    except RankFailed as exc:
        return exc.exit_code
    return 0


def _show_warning(message, category, filename, lineno, file=None, line=None):
    print(f"{message}", file=sys.stderr)


def _generate_rank(group, folder: str, gguf: str | None, dtype, prompt: str, cache_options: dict,
                   args: argparse.Namespace) -> int | None:
    from transformers.utils import logging as hf_logging

    from ..cli import generate_text

    if not group.is_leader:  # the leader speaks for every rank
        hf_logging.disable_progress_bar()
        warnings.simplefilter("ignore")
    warnings.showwarning = _show_warning
    model, tokenizer = load_sharded_model(folder, group, dtype=dtype, gguf_file=gguf)
    if not group.is_leader:
        follow(model, group)
        return None
    cache = install_sharded_cache(model, **cache_options)
    with lead(model, group):
        return generate_text(model, tokenizer, cache, prompt, args)
