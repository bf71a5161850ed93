"""Serving benchmark: a load generator against `pagedkv serve`, and transformers' `generate_batch`, in one run.

  1. `pagedkv serve` in a subprocess; `--num-prompts` streaming clients arrive as a Poisson process
     (`--rate` requests/s, at most `--concurrency` in flight), each sending a fixed prompt (a passage of
     Pride and Prejudice in the chat template, as token ids) for `--max-tokens` greedy tokens.
  2. The same prompts, all at once, through `pagedkv.LLM.generate` and through transformers' own
     continuous batching (`model.generate_batch`) on a fresh copy of the model.

Every request ignores EOS, so each side generates exactly the same number of tokens. Reports
requests/s, output tokens/s, time to first token (TTFT) and time per output token (TPOT) at p50/p90/p99,
prints a Markdown table and writes `serve.json` and `serve.md` to `--out`.

    python bench/serve.py --out bench/results
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import plotting  # noqa: E402  (bench/plotting.py, beside this script)
TEXT = ROOT.parent / "shared" / "data" / "pride-and-prejudice.txt"
FALLBACK = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
            "want of a wife. However little known the feelings or views of such a man may be on his first entering "
            "a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is "
            "considered the rightful property of some one or other of their daughters.")


def passages(n: int, seed: int) -> list[str]:
    """n passages of 30 to 120 words from the book (or a fixed paragraph when the book is not there)."""
    words = (TEXT.read_text(encoding="utf-8") if TEXT.exists() else FALLBACK * 50).split()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(30, 120)
        start = rng.randrange(0, len(words) - length)
        out.append(" ".join(words[start:start + length]))
    return out


def prompt_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    out = []
    for text in texts:
        messages = [{"role": "user", "content": f"Continue this passage:\n\n{text}"}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        out.append(list(ids["input_ids"]))
    return out


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def summary(name: str, seconds: float, ttft: list[float], tpot: list[float], tokens: int, requests: int) -> dict:
    return {"name": name, "seconds": seconds, "requests": requests, "output_tokens": tokens,
            "requests_per_s": requests / seconds, "output_tokens_per_s": tokens / seconds,
            **{f"ttft_p{q}_ms": pct(ttft, q) * 1e3 for q in (50, 90, 99)},
            **{f"tpot_p{q}_ms": pct(tpot, q) * 1e3 for q in (50, 90, 99)}}


# ----------------------------------------------------------------------------------------------
# 1. the server under Poisson arrivals
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(serve_args: list[str], port: int, threads: int, log_path: Path | None = None) -> subprocess.Popen:
    """`pagedkv serve --port PORT --device cpu SERVE_ARGS` with OMP_NUM_THREADS=threads, once /health answers; its
    output goes to `log_path` (default: stderr kept for the error if it exits)."""
    import httpx

    cmd = [sys.executable, "-m", "pagedkv", "serve", "--port", str(port), "--device", "cpu", *serve_args]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = open(log_path, "w") if log_path else subprocess.DEVNULL
    err = subprocess.STDOUT if log_path else subprocess.PIPE
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, env=env)
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            said = log_path.read_text()[-3000:] if log_path else proc.stderr.read().decode()
            raise RuntimeError(f"pagedkv serve exited: {said}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("pagedkv serve did not start")


async def one_client(http, base: str, model: str, ids: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first, tokens = None, 0
    async with http.stream("POST", f"{base}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"]:
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    return {"sent": sent, "first": first, "end": end, "tokens": tokens}


async def run_load(base: str, model: str, prompts: list[list[int]], args) -> list[dict]:
    import httpx

    rng = random.Random(args.seed)
    gate = asyncio.Semaphore(args.concurrency)
    start = time.perf_counter()
    arrivals, t = [], 0.0
    for _ in prompts:
        arrivals.append(t)
        t += rng.expovariate(args.rate)

    async def client(ids, at):
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        async with gate:
            async with httpx.AsyncClient(timeout=None) as http:
                return await one_client(http, base, model, ids, args.max_tokens)

    return await asyncio.gather(*(client(ids, at) for ids, at in zip(prompts, arrivals)))


def bench_server(args, prompts) -> dict:
    port = free_port()
    proc = start_server(["--model", args.model, "--num-blocks", str(args.num_blocks),
                         "--max-num-batched-tokens", str(args.max_num_batched_tokens)], port, args.threads)
    try:
        base = f"http://127.0.0.1:{port}"
        # one short request first, so one-time costs stay out of the numbers
        asyncio.run(run_load(base, args.model, prompts[:1], argparse.Namespace(**{**vars(args), "max_tokens": 2})))
        runs = asyncio.run(run_load(base, args.model, prompts, args))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    seconds = max(r["end"] for r in runs) - min(r["sent"] for r in runs)
    ttft = [r["first"] - r["sent"] for r in runs]
    tpot = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in runs if r["tokens"] > 1]
    name = f"pagedkv serve: Poisson arrivals at {args.rate:g}/s, up to {args.concurrency} clients"
    return summary(name, seconds, ttft, tpot, sum(r["tokens"] for r in runs), len(runs))


# ----------------------------------------------------------------------------------------------
# 2. everything at once: pagedkv LLM.generate and transformers generate_batch
def bench_llm(args, prompts) -> dict:
    from pagedkv import LLM, SamplingParams

    llm = LLM(args.model, device="cpu", num_blocks=args.num_blocks, max_num_batched_tokens=args.max_num_batched_tokens)
    llm.generate(prompts[0], SamplingParams(max_tokens=2))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
    seconds = time.perf_counter() - start
    ttft = [o.metrics.first_token_time - start for o in outs]
    tpot = [(o.metrics.finished_time - o.metrics.first_token_time) / (len(o.token_ids) - 1) for o in outs]
    return summary("pagedkv LLM.generate: all requests at once", seconds, ttft, tpot,
                   sum(len(o.token_ids) for o in outs), len(outs))


def bench_generate_batch(args, prompts) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from pagedkv.models import resolve_model_dir

    folder, gguf = resolve_model_dir(args.model)
    kwargs = {"gguf_file": gguf} if gguf else {}
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="sdpa",
                                                 **kwargs).eval()
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None  # every request runs to max_new_tokens, as on the pagedkv side
    config = GenerationConfig(max_new_tokens=args.max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate_batch(inputs=prompts[:1], generation_config=GenerationConfig(
        max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0), progress_bar=False)  # warm-up
    start = time.perf_counter()
    outs = model.generate_batch(inputs=prompts, generation_config=config, record_timestamps=True, progress_bar=False)
    seconds = time.perf_counter() - start
    outs = list(outs.values())
    ttft = [o.timestamps[0] - start for o in outs if o.timestamps]
    tpot = [(o.timestamps[-1] - o.timestamps[0]) / (len(o.timestamps) - 1) for o in outs if o.timestamps and len(o.timestamps) > 1]
    return summary("transformers generate_batch: all requests at once", seconds, ttft, tpot,
                   sum(len(o.generated_tokens) for o in outs), len(outs))


def table(rows: list[dict]) -> str:
    lines = ["| run | requests/s | output tokens/s | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p90 / p99 (ms) |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | "
                     f"{r['ttft_p50_ms']:.0f} / {r['ttft_p90_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
                     f"{r['tpot_p50_ms']:.0f} / {r['tpot_p90_ms']:.0f} / {r['tpot_p99_ms']:.0f} |")
    return "\n".join(lines)


def plot(rows: list[dict], title: str, path: Path) -> bool:
    """Output tokens/s per run, and time to first token / per output token percentiles."""
    plt = plotting.pyplot()
    if plt is None:
        return False
    names = [r["name"].replace(": ", "\n", 1) for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    axes[0].barh(names, [r["output_tokens_per_s"] for r in rows], color=[f"C{i}" for i in range(len(rows))])
    axes[0].invert_yaxis()
    axes[0].set_xlabel("output tokens/s (higher is better)")
    quantiles = ("p50", "p90", "p99")
    for ax, metric, label, scale in ((axes[1], "ttft", "time to first token (ms)", "log"),
                                     (axes[2], "tpot", "time per output token (ms)", "linear")):
        plotting.grouped_bars(ax, list(quantiles), {n: [r[f"{metric}_{q}_ms"] for q in quantiles] for n, r in zip(names, rows)})
        ax.set_yscale(scale)
        ax.set_ylabel(label + ", lower is better")  # colours as in the first panel, which names the runs
    fig.suptitle(title, fontsize=9)
    plotting.save(fig, path)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second (Poisson)")
    p.add_argument("--concurrency", type=int, default=16, help="clients in flight at most")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads on every side")
    p.add_argument("--skip-generate-batch", action="store_true")
    p.add_argument("--out", default=None, help="folder for serve.json, serve.md and serve.png")
    p.add_argument("--replot", default=None, metavar="JSON", help="only redraw serve.png next to this serve.json")
    args = p.parse_args(argv)
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        title = saved.get("head", saved["command"])
        return 0 if plot(saved["rows"], title, Path(args.replot).with_suffix(".png")) else 1

    import torch

    torch.set_num_threads(args.threads)
    from pagedkv import load_model

    _, tokenizer = load_model(args.model)
    prompts = prompt_ids(tokenizer, passages(args.num_prompts, args.seed))
    rows = [bench_server(args, prompts)]
    print(rows[-1], flush=True)
    rows.append(bench_llm(args, prompts))
    print(rows[-1], flush=True)
    if not args.skip_generate_batch:
        rows.append(bench_generate_batch(args, prompts))
        print(rows[-1], flush=True)
    import transformers

    head = (f"{args.num_prompts} requests, prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
            f"{args.max_tokens} new tokens each (greedy, EOS ignored); model {args.model}; "
            f"{datetime.date.today().isoformat()}, {os.cpu_count()} CPU cores, {args.threads} torch thread(s), torch {torch.__version__}, "
            f"transformers {transformers.__version__}")
    command = "python bench/serve.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = f"{head}\n\n{table(rows)}\n\nCommand: `{command}`\n"
    print("\n" + text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "serve.json").write_text(json.dumps({"args": vars(args), "command": command, "head": head, "rows": rows},
                                                   indent=2))
        (out / "serve.md").write_text(text)
        if plot(rows, head, out / "serve.png"):
            print(f"wrote {out / 'serve.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
