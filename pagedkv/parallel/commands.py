"""`pagedkv generate|serve --tensor-parallel N`: check the request, start N ranks, answer on rank 0.

Everything a user can get wrong (heads not divisible by N, more ranks than devices, a model without a
tensor-parallel plan, an indexed --device) is checked here, before any rank starts. Rank 0 then runs
the ordinary single-process code path (`generate_text`, or the engine behind the HTTP server) on its
shard, inside `lead`; the other ranks `follow`.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from .launcher import RankFailed, launch, ranks_on_this_host
from .model import check_model, load_sharded_model
from .step import follow, install_sharded_cache, lead


@dataclass(frozen=True)
class RankSetup:
    """What every rank needs to load its shard (host objects, sent to the spawned ranks)."""

    folder: str
    gguf_file: str | None
    dtype: torch.dtype
    device: str  # as given (cuda or cpu), for messages


def resolve_parallel_device(device: str, world_size: int) -> str:
    """The device type the ranks run on ("cuda": rank r on cuda:r; "cpu"), from --device."""
    parsed = torch.device(device)
    if parsed.index is not None:
        raise ConfigError(f"--device {device} with --tensor-parallel {world_size}: rank r runs on {parsed.type}:r; "
                          f"pass --device {parsed.type}")
    if parsed.type not in ("cuda", "cpu"):
        raise ConfigError(f"--device {device}: tensor parallelism runs on cuda (NCCL) or cpu (gloo)")
    return parsed.type


def _prepare(args: argparse.Namespace) -> tuple[RankSetup, str]:
    from ..models import resolve_model_dir
    from ..options import resolve_device_dtype

    device, dtype = resolve_device_dtype(args)
    device_type = resolve_parallel_device(device, args.tensor_parallel)
    folder, gguf = resolve_model_dir(args.model)
    check_model(folder, args.tensor_parallel, device_type, ranks_on_this_host(args.tensor_parallel))
    return RankSetup(str(folder), gguf, dtype, device), device_type


def _launch(rank_fn, args: argparse.Namespace, *rank_args) -> int:
    setup, device_type = _prepare(args)
    try:
        launch(rank_fn, args.tensor_parallel, device_type, setup, *rank_args)
    except RankFailed as exc:
        return exc.exit_code
    return 0


def generate_tensor_parallel(args: argparse.Namespace, prompt: str, cache_options: dict) -> int:
    return _launch(_generate_rank, args, prompt, cache_options, args)


def serve_tensor_parallel(args: argparse.Namespace, cache_options: dict, engine_options: dict) -> int:
    # decode steps replay CUDA graphs on every rank, as on one GPU (pagedkv.parallel.graphs)
    return _launch(_serve_rank, args, cache_options, engine_options, args)


def _show_warning(message, category, filename, lineno, file=None, line=None):
    print(f"{message}", file=sys.stderr)


def _load(group, setup: RankSetup):
    from transformers.utils import logging as hf_logging

    if not group.is_leader:  # the leader speaks for every rank
        hf_logging.disable_progress_bar()
        warnings.simplefilter("ignore")
    warnings.showwarning = _show_warning
    return load_sharded_model(setup.folder, group, dtype=setup.dtype, gguf_file=setup.gguf_file)


def _generate_rank(group, setup: RankSetup, prompt: str, cache_options: dict, args: argparse.Namespace):
    from ..text_generation import generate_text

    model, tokenizer = _load(group, setup)
    if not group.is_leader:
        follow(model, group)
        return None
    cache = install_sharded_cache(model, **cache_options)
    with lead(model, group):
        return generate_text(model, tokenizer, cache, prompt, args)


def _serve_rank(group, setup: RankSetup, cache_options: dict, engine_options: dict, args: argparse.Namespace):
    from ..engine import LLM
    from ..engine.server import serve

    model, tokenizer = _load(group, setup)
    if not group.is_leader:
        follow(model, group)
        return None
    llm = LLM(model, tokenizer=tokenizer, cache=install_sharded_cache(model, **cache_options), **engine_options)
    with lead(model, group):
        return serve(llm, args, f"{setup.device} x {group.world_size} ranks")
