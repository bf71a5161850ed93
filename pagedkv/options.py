"""The command-line options that `generate`, `serve` and tensor-parallel launch share, and their parsing.

This module sits below every command (`pagedkv.cli`, `pagedkv.engine.server`, `pagedkv.parallel.commands`,
`pagedkv.evaluate`): each adds the flags it takes here and turns the parsed values into validated
settings here, so the commands never import each other for their options.
"""

from __future__ import annotations

import argparse


def add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M-Instruct), a transformers folder, or a .gguf file")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="model dtype: fp32, bf16, fp16 (default fp32 on CPU, bf16 on CUDA)")


def resolve_device_dtype(args: argparse.Namespace) -> tuple:
    """(device, dtype) from --device / --dtype: cuda + bf16 when a GPU is there, else cpu + fp32."""
    import torch

    from .config import parse_dtype

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = parse_dtype(args.dtype, "--dtype") or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    return device, dtype


def add_tensor_parallel_option(p) -> None:
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="shard the model's heads over N ranks (GPUs with NCCL, CPU processes with gloo; default 1)")


def add_cache_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("paged KV cache")
    g.add_argument("--block-size", type=int, default=16, help="tokens per page block (default 16)")
    g.add_argument("--num-blocks", type=int, default=1024, help="blocks in the pool (default 1024)")
    g.add_argument("--dynamic", action="store_true", default=None,
                   help="grow the pool geometrically, capped by the context window (env PAGEDKV_DYNAMIC)")
    g.add_argument("--context-window-tokens", type=int, default=None,
                   help="growth cap per sequence (default: the model's max_position_embeddings)")
    g.add_argument("--paged-kv-quantization", default="off", metavar="FORMAT",
                   help="page format: off, q8, q6, q4[:rotate_keys], turboquant, turboquant:k=q4_0,v=q3_0[,rotate_keys]")
    g.add_argument("--recent-tokens", type=int, default=None, metavar="N",
                   help="keep the last N tokens of every sequence exact beside the quantized pages (a multiple of "
                        "--block-size; quantized formats only; default 0: off)")
    g.add_argument("--boundary-layers", type=int, default=0,
                   help="keep the first and last N layers dense when quantizing (default 0)")
    g.add_argument("--kernels", choices=("auto", "triton", "reference"), default=None,
                   help="attention kernels (env PAGEDKV_KERNELS; default auto)")


def cache_options(args: argparse.Namespace) -> dict:
    """Validated `PagedKVCache` options from the parsed flags (raises ConfigError on bad values)."""
    from .config import CacheConfig

    opts = dict(block_size=args.block_size, num_blocks=args.num_blocks, dynamic=args.dynamic,
                context_window_tokens=args.context_window_tokens, kv_format=args.paged_kv_quantization,
                boundary_layers=args.boundary_layers, kernels=args.kernels, recent_tokens=args.recent_tokens)
    CacheConfig.build(**opts)  # validate before loading a model
    return opts


def add_speculative_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative", default=None, metavar="SPEC",
                   help="draft tokens and verify them in one forward: 'ngram' (prompt lookup), 'ngram:min=2,max=4', "
                        "'draft:model=PATH' (a smaller model with the same tokenizer; layers=N keeps its first N "
                        "layers); default off")
    g.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="tokens drafted per step at most (default 4; adaptive per request)")


def speculative_options(args: argparse.Namespace):
    """The validated `SpeculativeConfig` of --speculative / --num-speculative-tokens, or None (off)."""
    from .engine.spec import SpeculativeConfig
    from .errors import ConfigError

    if args.speculative is None:
        if args.num_speculative_tokens is not None:
            raise ConfigError("--num-speculative-tokens needs --speculative (e.g. --speculative ngram)")
        return None
    config = SpeculativeConfig.build(args.speculative)
    if args.num_speculative_tokens is not None:
        config = SpeculativeConfig(**{**config.__dict__, "num_speculative_tokens": args.num_speculative_tokens})
    return config
