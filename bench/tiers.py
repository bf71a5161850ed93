"""Time to first token of a returning conversation, by where its prefix comes from: the device pool, the host
tier, the disk tier (files in the page cache, or evicted from it), or a recompute.

A multi-turn chat workload: each conversation is a `--prefix-tokens` history (passages of Pride and
Prejudice in the chat template) followed by short user turns, the model answering `--answer-tokens`
tokens each time. The device pool holds about one conversation, so when the next conversation runs,
the previous one's blocks leave the device for the host tier (and the disk tier's files).
Per conversation and prefix length:

    turn 1           nothing cached anywhere                    -> recompute
    turn 2           right after turn 1                         -> device
    turn 3           after another conversation evicted it      -> host tier
    turn 4 (engine restarted on the same --kv-cache-dir, no host tier), files in the page cache -> disk (warm)
    turn 4 of another conversation, files dropped from the page cache first                  -> disk (cold)

The restarted engine is a new `LLM` in the same process (the model stays loaded); block hashes are the
same across processes (tests/test_tiers.py checks it). Prints a table, writes JSON and a PNG plot.

    python bench/tiers.py --prefix-tokens 2048 8000 --out bench/results            # CPU, default model
    python bench/tiers.py --model llama8b --device cuda --prefix-tokens 2048 8192 32768 --out bench/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import plotting  # noqa: E402  (bench/plotting.py, beside this script)

from pagedkv import LLM, SamplingParams, load_model  # noqa: E402

BOOK = Path(__file__).resolve().parents[2] / "shared" / "data" / "pride-and-prejudice.txt"
SOURCES = ["recompute", "device", "host", "disk (page cache)", "disk (cold)"]
TURN_ROOM = 192  # tokens past the prefix: four turns and answers
TURNS = ["What happens next?", "Who is speaking here?", "Summarise that in one line.", "Go on."]


def build_model(name: str, device: str, max_len: int, tiny: bool = False, layers: int = 8):
    if name == "llama8b":  # the Llama-3-8B shape of bench/engine_gpu.py (`layers` of its 32), random bf16 weights
        import engine_gpu

        engine_gpu.DEVICE = device
        model = engine_gpu.build_model(layers, tiny=tiny)
        model.config.max_position_embeddings = max_len
        return model, None
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    return load_model(name, dtype=dtype, device=device)


class Conversations:
    """Token ids of chat histories and turns (text from the book, or random ids without a tokenizer)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.text = BOOK.read_text() if BOOK.exists() else None
        self.count = 0

    def history(self, num_tokens: int) -> list[int]:
        self.count += 1
        if self.tokenizer is None or self.text is None:
            g = torch.Generator().manual_seed(self.count)
            return torch.randint(0, self.vocab_size, (num_tokens,), generator=g).tolist()
        start = (self.count * 7919 * 13) % (len(self.text) // 2)
        passage = self.text[start:start + num_tokens * 6]
        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": "Read this: " + passage}],
                                                 tokenize=True, add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return ids[:num_tokens]

    def turn(self, i: int) -> list[int]:
        if self.tokenizer is None:
            return list(range(100 + i, 124 + i))
        return self.tokenizer(f"\nUser: {TURNS[i % len(TURNS)]}\nAssistant:").input_ids


def ask(llm: LLM, prompt: list[int], answer_tokens: int) -> tuple[float, list[int], dict]:
    """Run one turn; returns (time to first token in s, the answer's token ids, the engine's stats after it).

    Then the user's think time: the tiers' copies and the disk writer's queue finish before the next turn.
    Without it, a 32K-token conversation (1 GiB of llama8b pages) queued behind another would overflow the
    writer's queue (writes are dropped past 4x its high-water mark) and the disk tier would miss blocks."""
    out = llm.generate(prompt, SamplingParams(max_tokens=answer_tokens, ignore_eos=True))[0]
    ttft = out.metrics.first_token_time - out.metrics.arrival_time
    prefix = llm.engine.prefix
    prefix.poll(wait=True)
    if prefix.disk is not None:
        prefix.disk.flush()
    return ttft, out.outputs[0].token_ids, llm.stats()


def drop_from_page_cache(directory: Path) -> int:
    """posix_fadvise(DONTNEED) on every block file: the next read comes from the disk. Returns files dropped."""
    n = 0
    for path in directory.rglob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


def measure_length(model, tokenizer, args, prefix_tokens: int, kv_dir: Path, log) -> dict:
    conv = Conversations(tokenizer, model.config.vocab_size)
    bs = 16
    turn_room = 4 * (max(len(conv.turn(i)) for i in range(4)) + args.answer_tokens)
    # the longest turn of one conversation: the next conversation evicts nearly all of this one's blocks
    num_blocks = -(-(prefix_tokens + turn_room) // bs) + 1
    common = dict(kv_format=args.kv_format, num_blocks=num_blocks, max_model_len=args.max_model_len,
                  max_num_batched_tokens=args.chunk, enforce_eager=args.enforce_eager)
    times = {s: [] for s in SOURCES}
    host_gb = 3 * (prefix_tokens + turn_room) * dense_bytes_per_token(model) / 2**30  # three conversations
    llm = LLM(model, tokenizer=tokenizer, cpu_cache_gb=host_gb, kv_cache_dir=str(kv_dir), **common)
    prompts, host_fraction = {}, []
    for rep in range(args.reps):
        for name in ("a", "b"):  # b evicts a from the device, and a evicts b
            key = (rep, name)
            prompt = conv.history(prefix_tokens)
            t, answer, stats = ask(llm, prompt, args.answer_tokens)
            times["recompute"].append(t)
            log(f"  {prefix_tokens} tokens, conversation {rep}{name}: recompute {t * 1e3:.0f} ms")
            prompt = prompt + answer + conv.turn(1)
            t, answer, stats = ask(llm, prompt, args.answer_tokens)
            assert stats["tier_gpu_hits"] > 0, stats
            times["device"].append(t)
            log(f"    from the device {t * 1e3:.0f} ms")
            prompts[key] = prompt + answer
        for name in ("a", "b"):  # each was evicted from the device by the other
            key = (rep, name)
            before = llm.stats()["tier_host_hits"]
            prompt = prompts[key] + conv.turn(2)
            t, answer, stats = ask(llm, prompt, args.answer_tokens)
            from_host = stats["tier_host_hits"] - before
            assert from_host >= (prefix_tokens // bs) * 0.8, stats  # the rest still sat in the device pool
            times["host"].append(t)
            host_fraction.append(from_host / (len(prompt) // bs))
            log(f"    conversation {rep}{name} from the host tier {t * 1e3:.0f} ms ({from_host} blocks from the host)")
            prompts[key] = prompt + answer
    stats = llm.stats()
    block_bytes = stats["tier_block_bytes"]
    copy = {"host_load_gbps": stats["tier_load_gbps"], "offload_gbps": stats["tier_offload_gbps"]}
    llm.engine.prefix.close()  # as a server does on shutdown: the queued disk writes finish
    del llm
    restarted = LLM(model, tokenizer=tokenizer, kv_cache_dir=str(kv_dir), **common)
    for rep in range(args.reps):
        for name, source in (("a", "disk (page cache)"), ("b", "disk (cold)")):
            if source == "disk (cold)":
                drop_from_page_cache(kv_dir)
            before = restarted.stats()["tier_disk_hits"]
            t, _, stats = ask(restarted, prompts[(rep, name)] + conv.turn(3), args.answer_tokens)
            assert stats["tier_disk_hits"] - before >= prefix_tokens // bs, stats
            times[source].append(t)
            log(f"    conversation {rep}{name} from {source} {t * 1e3:.0f} ms")
    copy["disk_load_gbps"] = restarted.stats()["tier_load_gbps"]
    copy.update(copy_bandwidth(restarted))
    log(f"    copies of {copy['blocks']} whole blocks: device->host {copy['device_to_host_gbps']:.1f} GB/s, "
        f"host->device {copy['host_to_device_gbps']:.1f} GB/s")
    restarted.engine.prefix.close()
    medians = {s: statistics.median(v) for s, v in times.items()}
    return {"prefix_tokens": prefix_tokens, "ttft_s": times, "ttft_median_s": medians,
            "vs_recompute": {s: medians[s] / medians["recompute"] for s in SOURCES},
            "host_fraction_of_blocks": host_fraction, "block_bytes": block_bytes, "copy": copy}


def dense_bytes_per_token(model) -> int:
    """Bytes one token's keys and values take in every layer at the model's dtype (quantized pages take less)."""
    from pagedkv.hf import text_config

    text = text_config(model.config)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * heads * head_dim * next(model.parameters()).element_size()


def copy_bandwidth(llm: LLM, repeats: int = 3) -> dict:
    """The tiers' copy path alone, synchronized: every block of the pool gathered (all layers of a block in
    one row) and copied to pinned host memory, then copied back and scattered to the same blocks (so the
    pool's contents do not change). Best of `repeats`, GB/s."""
    from pagedkv.tiers.layout import words

    prefix, cache = llm.engine.prefix, llm.engine.cache
    layout, is_cuda = prefix.layout, prefix.is_cuda
    sync = torch.cuda.synchronize if is_cuda else (lambda: None)
    ids = list(range(cache.pool.num_blocks))
    host = torch.empty(len(ids), layout.block_bytes, dtype=torch.uint8, pin_memory=is_cuda)
    d2h = h2d = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        words(host).copy_(words(layout.gather(cache, ids)), non_blocking=True)
        sync()
        d2h = min(d2h, time.perf_counter() - start)
        start = time.perf_counter()
        layout.scatter(cache, ids, host)
        sync()
        h2d = min(h2d, time.perf_counter() - start)
    return {"blocks": len(ids), "device_to_host_gbps": host.numel() / d2h / 1e9,
            "host_to_device_gbps": host.numel() / h2d / 1e9}


def plot(results: dict, path: Path) -> bool:
    plt = plotting.pyplot()
    if plt is None:
        return False
    rows = results["rows"]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    cats = [f"{r['prefix_tokens']:,} tokens" for r in rows]
    series = {s: [r["ttft_median_s"][s] * 1e3 for r in rows] for s in SOURCES}
    bars = plotting.grouped_bars(ax, cats, series)
    for container, source in zip(bars, SOURCES):
        labels = [f"{r['vs_recompute'][source]:.2f}x" if source != "recompute" else "" for r in rows]
        ax.bar_label(container, labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("time to first token (ms, log)")
    ax.legend(fontsize=8)
    ax.set_title(f"TTFT of a returning conversation by prefix source: {results['model']}, "
                 f"{results['kv_format']}, {results['device_name']}", fontsize=9)
    plotting.save(fig, path)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="'default' (SmolLM2), a model path, or 'llama8b' (8 layers, random)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prefix-tokens", type=int, nargs="+", default=[2048, 8000])
    ap.add_argument("--answer-tokens", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2, help="pairs of conversations per prefix length")
    ap.add_argument("--kv-format", default="off")
    ap.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens (the prefill chunk)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-dir", default=None, help="where the disk tier writes (default: a temporary dir)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--layers", type=int, default=8, help="with --model llama8b: decoder layers (32 is the real model's)")
    ap.add_argument("--tiny", action="store_true", help="with --model llama8b: a tiny model of the same kind (a smoke test)")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.max_model_len = max(args.prefix_tokens) + TURN_ROOM
    model, tokenizer = build_model(args.model, args.device, args.max_model_len, args.tiny, args.layers)
    window = getattr(model.config, "max_position_embeddings", None)
    if window and args.max_model_len > window:
        ap.error(f"--prefix-tokens {max(args.prefix_tokens)} and the turns do not fit the model's context window "
                 f"of {window} tokens; the longest prefix is {window - TURN_ROOM}")
    root = Path(args.kv_cache_dir or tempfile.mkdtemp(prefix="pagedkv-tiers-"))
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU ({args.threads} threads)"
    started = time.time()
    rows = []
    for n in args.prefix_tokens:
        kv_dir = root / f"prefix{n}"
        shutil.rmtree(kv_dir, ignore_errors=True)
        rows.append(measure_length(model, tokenizer, args, n, kv_dir,
                                   lambda msg: print(f"[{time.time() - started:6.0f} s] {msg}", flush=True)))
    results = {"date": datetime.date.today().isoformat(), "model": args.model, "device": args.device,
               "device_name": device_name, "kv_format": args.kv_format, "torch": torch.__version__,
               "kv_cache_dir": str(root), "args": {k: v for k, v in vars(args).items()}, "rows": rows,
               "command": "python bench/tiers.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tiers.json").write_text(json.dumps(results, indent=1))
    print(f"\n{args.model}, {args.kv_format} pages, {device_name}; median TTFT in ms (x recompute)")
    print("| prefix tokens | " + " | ".join(SOURCES) + " |")
    print("| ---: | " + " | ".join("---:" for _ in SOURCES) + " |")
    for r in rows:
        cells = [f"{r['ttft_median_s'][s] * 1e3:.0f}" + ("" if s == "recompute" else f" ({r['vs_recompute'][s]:.2f}x)")
                 for s in SOURCES]
        print(f"| {r['prefix_tokens']:,} | " + " | ".join(cells) + " |")
    for r in rows:
        print(f"{r['prefix_tokens']:,} tokens: block {r['block_bytes']:,} bytes; copies {r['copy']}")
    if plot(results, out / "tiers.png"):
        print(f"wrote {out / 'tiers.json'} and {out / 'tiers.png'}")
    if not args.kv_cache_dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
