"""Decode tokens/s with tensor parallelism: 1 rank against N ranks, same model, same batch, one run.

A Llama-3-8B-shaped model (hidden 4096, 32 query / 8 KV heads, head_dim 128, MLP 14336, vocab 128256;
`--layers` of them) is randomly initialised once and saved to `--model-dir`; each configuration then
starts its ranks (`pagedkv.parallel.launch`: NCCL on CUDA, gloo on the CPU), loads its shard, prefills
`--batch` sequences of `--context` random tokens and times `--steps` packed decode steps (one token per
sequence, as the engine's model runner issues them) on rank 0, which plans every step and broadcasts it.
`--shape small` is a scaled-down model for CPU runs. Prints one JSON line per configuration and the ratio;
`--out` also writes them to a file.

    python bench/tensor_parallel.py --device cuda --ranks 1 2 --batch 64 --layers 32 --out bench/results
    python bench/tensor_parallel.py --device cpu --shape small --layers 4 --ranks 1 2 1 2 --threads-per-rank 1
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagedkv.hf import cache_kwarg  # noqa: E402
from pagedkv.parallel import follow, install_sharded_cache, launch, lead, load_sharded_model  # noqa: E402
from pagedkv.parallel.model import check_model  # noqa: E402

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      vocab_size=128256),
    "small": dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=16, num_key_value_heads=8,
                  vocab_size=32000),
}


def save_random_model(folder: Path, shape: str, num_layers: int, dtype: torch.dtype) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").exists():
        return
    config = LlamaConfig(**SHAPES[shape], num_hidden_layers=num_layers, max_position_embeddings=8192,
                         rope_theta=500000.0, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(folder)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def decode_tokens_per_s(model, cache, batch: int, context: int, steps: int, warm: int = 3) -> float:
    """Prefill `batch` random prompts of `context` tokens, then time packed decode steps (greedy)."""
    device = model.device
    vocab = model.config.vocab_size
    kw = {cache_kwarg(model): cache}
    g = torch.Generator().manual_seed(0)
    seq_ids = [cache.add_sequence() for _ in range(batch)]
    tokens = None
    for i, sid in enumerate(seq_ids):  # one prefill per sequence keeps the activations small
        prompt = torch.randint(0, vocab, (1, context), generator=g)
        cache.begin_step([sid], [context], device=device)
        try:
            logits = model(input_ids=prompt.to(device), position_ids=torch.arange(context, device=device)[None],
                           logits_to_keep=1, use_cache=True, **kw).logits
        finally:
            cache.end_forward()
        tokens = logits[:, -1].argmax(-1) if tokens is None else torch.cat([tokens, logits[:, -1].argmax(-1)])
    for step in range(warm + steps):
        if step == warm:
            _sync(device)
            start = time.perf_counter()
        positions = torch.full((1, batch), context + step, device=device)
        cache.begin_step(seq_ids, [1] * batch, device=device)
        try:
            logits = model(input_ids=tokens[None], position_ids=positions, use_cache=True, **kw).logits
        finally:
            cache.end_forward()
        tokens = logits[0].argmax(-1)  # [batch]
    _sync(device)
    return batch * steps / (time.perf_counter() - start)


def bench_rank(group, folder: str, dtype: torch.dtype, args: argparse.Namespace):
    if args.threads_per_rank:
        torch.set_num_threads(args.threads_per_rank)
    model, _ = load_sharded_model(folder, group, dtype=dtype)
    if not group.is_leader:
        follow(model, group)
        return None
    blocks = args.batch * -(-(args.context + args.steps + 4) // args.block_size)
    cache = install_sharded_cache(model, kv_format=args.kv_format, block_size=args.block_size, num_blocks=blocks)
    with lead(model, group):
        tps = decode_tokens_per_s(model, cache, args.batch, args.context, args.steps)
    return {"ranks": group.world_size, "decode_tokens_per_s": round(tps, 2), "kv_bytes_per_rank": cache.nbytes()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=512, help="prompt tokens per sequence before decoding")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-format", default="off")
    p.add_argument("--dtype", default=None, help="bf16 (default on CUDA) or fp32 (default on the CPU)")
    p.add_argument("--threads-per-rank", type=int, default=None,
                   help="CPU threads of each rank (default: the cores shared out); 1 compares ranks like GPUs")
    p.add_argument("--model-dir", default=None, help="where the random model is saved (default /tmp/pagedkv-tp-<shape>-<layers>)")
    p.add_argument("--out", default=None, help="a folder for the JSON results")
    args = p.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[args.dtype] or (
        torch.bfloat16 if args.device == "cuda" else torch.float32)
    folder = Path(args.model_dir or f"/tmp/pagedkv-tp-{args.shape}-{args.layers}")
    save_random_model(folder, args.shape, args.layers, dtype)
    results = []
    for n in args.ranks:
        check_model(folder, n, args.device)
        result = launch(bench_rank, n, args.device, str(folder), dtype, args)[0]
        result.update(threads_per_rank=args.threads_per_rank, device=args.device, shape=args.shape, layers=args.layers, batch=args.batch,
                      context=args.context, steps=args.steps, kv_format=args.kv_format, dtype=str(dtype))
        print(json.dumps(result), flush=True)
        results.append(result)
    base = results[0]["decode_tokens_per_s"]
    for r in results[1:]:
        print(f"{r['ranks']} ranks / {results[0]['ranks']} rank: {r['decode_tokens_per_s'] / base:.2f}x decode tokens/s")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = out / f"tensor_parallel-{args.device}-{stamp}.json"
        path.write_text(json.dumps({"command": " ".join(sys.argv), "results": results}, indent=2))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
