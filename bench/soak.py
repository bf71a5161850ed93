"""Soak test: `pagedkv serve` under Poisson arrivals for a set time, with the traffic a public server gets.

The mix: streaming chat completions, non-streaming completions, clients that hang up (a stream after its
first chunk, a waiting client after a short timeout) and malformed or hostile requests. Every few seconds
it samples the server's resident memory and its /metrics (blocks in use, running and waiting requests).
When the time is up it stops sending, lets the requests in flight finish, and reads the blocks still in use.

Reports requests served, answers by status, server-side errors (5xx, error events in streams, generation
errors, tracebacks in the server's log), TTFT and TPOT percentiles of the streamed requests sent in the
first and in the last fifth of the run, resident memory at the start and the end, and blocks in use after
the load; writes soak.json, soak.png (over time) and soak_server.log to --out, and exits with 1 when a
check fails: no server-side error, 0 blocks in use after the load, memory growth under 10%, last-fifth
p99 TTFT within 1.5x of the first fifth's.

    python bench/soak.py --out bench/results              # 30 minutes, the default model on the CPU
    python bench/soak.py --minutes 2 --out /tmp/soak      # a quick check of the script
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plotting  # noqa: E402  (bench/plotting.py)
from serve import free_port, passages, pct, start_server  # noqa: E402  (bench/serve.py)

ROOT = Path(__file__).resolve().parents[1]
KINDS = {"stream": 0.4, "whole": 0.3, "hang_up_stream": 0.1, "hang_up_whole": 0.05, "malformed": 0.15}
MALFORMED = [  # (body bytes or JSON, what it breaks); each must get a 4xx
    (b'{"model": "default", "messages": [', "truncated JSON"),
    (b"\xff\xfe not utf-8", "bytes that are not UTF-8"),
    ([], "a JSON array instead of an object"),
    ({"model": "default", "messages": []}, "no messages"),
    ({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, "unknown model"),
    ({"model": "default", "messages": [{"role": "wizard", "content": "hi"}]}, "unknown role"),
    ({"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, "negative max_tokens"),
    ({"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**7}, "past the window"),
    ({"model": "default", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "wrong type"),
    ({"model": "default", "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p 0"),
    ({"model": "default", "messages": [{"role": "user", "content": "hi"}], "seed": 2**70}, "seed past 64 bits"),
    ({"model": "default", "prompt": [10**9]}, "token id out of range"),
    ({"model": "default", "prompt": ""}, "empty prompt"),
]


def server_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def read_metrics(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")}


# ----------------------------------------------------------------------------------------------
# the clients: each returns a record of what it saw
async def stream_chat(http, base, text, rng, hang_up: bool) -> dict:
    body = {"model": "default", "messages": [{"role": "user", "content": f"Continue this passage:\n\n{text}"}],
            "max_tokens": rng.randint(16, 64), "stream": True, "temperature": rng.choice([0, 0.7]),
            "seed": rng.randrange(2**31), "stream_options": {"include_usage": True}}
    sent, first, tokens, errors = time.perf_counter(), None, 0, 0
    async with http.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "body": (await r.aread()).decode(errors="replace")[:300]}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            errors += "error" in chunk
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter()
                if hang_up:
                    return {"status": 200, "hung_up": True}
    end = time.perf_counter()
    out = {"status": 200, "stream_errors": errors, "tokens": tokens}
    if first is not None:
        out["ttft"] = first - sent
        if tokens > 1:
            out["tpot"] = (end - first) / (tokens - 1)
    return out


async def whole_completion(http, base, text, rng, hang_up: bool) -> dict:
    body = {"model": "default", "prompt": text, "max_tokens": rng.randint(16, 64), "temperature": 0}
    try:
        r = await http.post(f"{base}/v1/completions", json=body, timeout=rng.uniform(0.2, 1.0) if hang_up else None)
    except httpx.TimeoutException:
        return {"status": 200, "hung_up": True}  # the client gave up; the server aborts the request
    out = {"status": r.status_code}
    if r.status_code == 200:
        out["tokens"] = r.json()["usage"]["completion_tokens"]
    else:
        out["body"] = r.text[:300]
    return out


async def malformed(http, base, rng) -> dict:
    body, what = MALFORMED[rng.randrange(len(MALFORMED))]
    path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = await http.post(f"{base}{path}", content=content, headers={"content-type": "application/json"})
    ok = 400 <= r.status_code < 500 and "error" in r.json() and "message" in r.json()["error"]
    return {"status": r.status_code, "malformed": what, "openai_error_body": ok}


async def run_load(base: str, args, texts: list[str], records: list, stop_at: float, monitor) -> None:
    """Send requests as a Poisson process until `stop_at` (clients still waiting for a slot then are not sent),
    then wait for those in flight; `monitor()` runs beside them until they are done."""
    rng = random.Random(args.seed)
    gate = asyncio.Semaphore(args.concurrency)
    kinds, weights = list(KINDS), list(KINDS.values())
    start = time.perf_counter()
    tasks = []

    async def client(kind: str, text: str, crng: random.Random):
        async with gate:
            if time.perf_counter() >= stop_at:
                return
            record = {"kind": kind, "t": time.perf_counter() - start}
            try:
                async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as http:
                    if kind in ("stream", "hang_up_stream"):
                        record.update(await stream_chat(http, base, text, crng, kind == "hang_up_stream"))
                    elif kind in ("whole", "hang_up_whole"):
                        record.update(await whole_completion(http, base, text, crng, kind == "hang_up_whole"))
                    else:
                        record.update(await malformed(http, base, crng))
            except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
                record.update(status="client_error", error=f"{type(exc).__name__}: {exc}"[:300])
            records.append(record)

    watcher = asyncio.ensure_future(monitor())
    while time.perf_counter() < stop_at:
        tasks.append(asyncio.ensure_future(client(rng.choices(kinds, weights)[0], rng.choice(texts),
                                                  random.Random(rng.random()))))
        await asyncio.sleep(min(rng.expovariate(args.rate), max(0.0, stop_at - time.perf_counter())))
    await asyncio.gather(*tasks)
    watcher.cancel()


async def warm_up(base: str, texts: list[str]) -> None:
    """The load's longest requests, all at once: the batch shapes and context lengths the run reaches."""
    async with httpx.AsyncClient(timeout=1200) as http:
        await asyncio.gather(*(http.post(f"{base}/v1/chat/completions", json={
            "model": "default", "messages": [{"role": "user", "content": f"Continue this passage:\n\n{text}"}],
            "max_tokens": 64, "temperature": 0, "ignore_eos": True}) for text in texts))


# ----------------------------------------------------------------------------------------------
def sample(t: float, pid: int, m: dict[str, float]) -> dict:
    return {"t": t, "rss_mb": server_rss_mb(pid), "blocks_used": m["pagedkv_kv_blocks_used"],
            "running": m["pagedkv_requests_running"], "waiting": m["pagedkv_requests_waiting"],
            "preemptions": m["pagedkv_preemptions_total"]}


def count_statuses(records: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in list(records):
        out[str(r["status"])] = out.get(str(r["status"]), 0) + 1
    return out


def fifth_stats(records: list[dict], seconds: float, which: int) -> dict:
    """TTFT and TPOT percentiles of the streams sent in the first (which=0) or last (4) fifth of `seconds`."""
    lo, hi = (0, seconds / 5) if which == 0 else (seconds * 4 / 5, seconds)
    part = [r for r in records if lo <= r["t"] < hi]
    ttft = [r["ttft"] for r in part if "ttft" in r]
    tpot = [r["tpot"] for r in part if "tpot" in r]
    return {"streams": len(ttft), **{f"ttft_p{q}_s": pct(ttft, q) for q in (50, 90, 99)},
            **{f"tpot_p{q}_ms": pct(tpot, q) * 1e3 for q in (50, 90, 99)}}


def plot(result: dict, path: Path) -> bool:
    plt = plotting.pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    streams = [r for r in result["records"] if "ttft" in r]
    axes[0].scatter([r["t"] / 60 for r in streams], [r["ttft"] for r in streams], s=6, alpha=0.6, label="TTFT")
    axes[0].scatter([r["t"] / 60 for r in streams if "tpot" in r], [r["tpot"] for r in streams if "tpot" in r], s=6,
                    alpha=0.6, label="TPOT")
    axes[0].set_ylabel("seconds")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8)
    samples = result["samples"]
    minutes = [s["t"] / 60 for s in samples]
    axes[1].plot(minutes, [s["rss_mb"] for s in samples], color="C2")
    axes[1].set_ylabel("server RSS (MiB)")
    axes[2].plot(minutes, [s["blocks_used"] for s in samples], label="blocks in use", color="C3")
    axes[2].plot(minutes, [s["running"] for s in samples], label="requests running", color="C4")
    axes[2].plot(minutes, [s["waiting"] for s in samples], label="requests waiting", color="C5")
    axes[2].set_xlabel("minutes")
    axes[2].legend(fontsize=8)
    a = result["args"]
    axes[0].set_title(f"pagedkv serve soak: {a['minutes']:g} min, Poisson {a['rate']:g} req/s, {a['model']} on the "
                      f"CPU, {result['date']}\n{result['served']} served, "
                      f"{result['server_side_errors']} server-side errors, "
                      f"{result['blocks_in_use_after']:.0f} blocks in use after", fontsize=9)
    plotting.save(fig, path)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0, help="how long requests are sent (default 30)")
    p.add_argument("--rate", type=float, default=0.2, help="Poisson arrivals per second (default 0.2)")
    p.add_argument("--concurrency", type=int, default=8, help="clients in flight at most (default 8)")
    p.add_argument("--model", default="default")
    p.add_argument("--num-blocks", type=int, default=256, help="the server's pool (default 256 blocks of 16)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--threads", type=int, default=2, help="the server's OMP_NUM_THREADS (default 2)")
    p.add_argument("--sample-seconds", type=float, default=10.0, help="memory and /metrics sampling period")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results", help="folder for soak.json, soak.png, soak_server.log")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    print(f"starting pagedkv serve on {base} ...", flush=True)
    proc = start_server(["--model", args.model, "--num-blocks", str(args.num_blocks), "--max-num-seqs",
                         str(args.max_num_seqs)], port, args.threads, out / "soak_server.log")
    records: list[dict] = []
    samples: list[dict] = []
    try:
        # a burst of requests first, so one-time costs (first forwards, allocator growth to the batch sizes the
        # load reaches) are not counted as growth of the resident memory
        texts = passages(200, args.seed)
        asyncio.run(warm_up(base, sorted(texts, key=len)[-args.concurrency:]))
        rss_start = server_rss_mb(proc.pid)
        t0 = time.perf_counter()
        stop_at = t0 + args.minutes * 60

        async def monitor():  # memory and /metrics every --sample-seconds, a progress line every 30 s
            next_print = 0.0
            async with httpx.AsyncClient(timeout=30) as http:
                while True:
                    now = time.perf_counter() - t0
                    text = (await http.get(f"{base}/metrics")).text
                    m = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                         if line and not line.startswith("#")}
                    samples.append(sample(now, proc.pid, m))
                    if now >= next_print:
                        next_print = now + 30
                        by_status = count_statuses(records)
                        s = samples[-1]
                        print(f"[{now / 60:5.1f}/{args.minutes:g} min] {len(records)} answered {by_status}, running "
                              f"{s['running']:.0f}, waiting {s['waiting']:.0f}, blocks {s['blocks_used']:.0f}, "
                              f"RSS {s['rss_mb']:.0f} MiB, preemptions {s['preemptions']:.0f}", flush=True)
                    await asyncio.sleep(args.sample_seconds)

        asyncio.run(run_load(base, args, texts, records, stop_at, monitor))
        seconds = time.perf_counter() - t0
        print(f"load stopped after {seconds / 60:.1f} min; waiting for the pool to drain ...", flush=True)
        deadline = time.time() + 60  # hung-up requests are aborted at the next step boundary
        while (m := read_metrics(base))["pagedkv_kv_blocks_used"] and time.time() < deadline:
            time.sleep(0.5)
        blocks_after = m["pagedkv_kv_blocks_used"]
        healthy = httpx.get(f"{base}/health", timeout=10).status_code == 200
        rss_end = server_rss_mb(proc.pid)
        samples.append(sample(time.perf_counter() - t0, proc.pid, m))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    log = (out / "soak_server.log").read_text(errors="replace")
    by_status = count_statuses(records)
    five_xx = sum(n for s, n in by_status.items() if s.isdigit() and int(s) >= 500)
    stream_errors = sum(r.get("stream_errors", 0) for r in records)
    generation_errors = sum("generation_error" in r.get("body", "") for r in records)
    malformed_ok = all(r["openai_error_body"] for r in records if "malformed" in r)
    server_side = five_xx + stream_errors + generation_errors + log.count("Traceback")
    first, last = fifth_stats(records, args.minutes * 60, 0), fifth_stats(records, args.minutes * 60, 4)
    growth = (rss_end - rss_start) / rss_start
    checks = {
        "no server-side error": server_side == 0 and by_status.get("client_error", 0) == 0,
        "malformed requests get a 4xx with the OpenAI error body": malformed_ok,
        "0 blocks in use after the load": blocks_after == 0 and healthy,
        "resident memory growth under 10%": growth < 0.10,
        "last-fifth p99 TTFT within 1.5x of the first fifth's": last["ttft_p99_s"] <= 1.5 * first["ttft_p99_s"],
    }
    result = {"date": datetime.date.today().isoformat(), "args": vars(args),
              "command": "python bench/soak.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "seconds": seconds, "requests": len(records), "served": sum(r["status"] == 200 for r in records),
              "by_kind": {k: sum(r["kind"] == k for r in records) for k in KINDS}, "by_status": by_status,
              "five_xx": five_xx, "stream_error_events": stream_errors, "generation_errors": generation_errors,
              "tracebacks_in_server_log": log.count("Traceback"), "server_side_errors": server_side,
              "first_fifth": first, "last_fifth": last, "rss_start_mb": rss_start, "rss_end_mb": rss_end,
              "rss_growth": growth, "blocks_in_use_after": blocks_after, "healthy_after": healthy,
              "preemptions": samples[-1]["preemptions"], "checks": checks, "samples": samples, "records": records}
    (out / "soak.json").write_text(json.dumps(result, indent=2, default=str))
    plot(result, out / "soak.png")
    print(f"\n{result['requests']} requests in {seconds / 60:.1f} min ({result['by_kind']}), {result['served']} "
          f"served; by status {by_status}; server-side errors {server_side}; preemptions "
          f"{result['preemptions']:.0f}")
    for name, part in (("first fifth", first), ("last fifth", last)):
        print(f"{name}: {part['streams']} streams, TTFT p50/p90/p99 {part['ttft_p50_s']:.2f} / {part['ttft_p90_s']:.2f}"
              f" / {part['ttft_p99_s']:.2f} s, TPOT p50/p90/p99 {part['tpot_p50_ms']:.0f} / {part['tpot_p90_ms']:.0f}"
              f" / {part['tpot_p99_ms']:.0f} ms")
    print(f"server RSS {rss_start:.0f} -> {rss_end:.0f} MiB ({growth:+.1%}); blocks in use after the load: "
          f"{blocks_after:.0f}")
    for name, ok in checks.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    print(f"wrote {out / 'soak.json'}, {out / 'soak.png'}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
