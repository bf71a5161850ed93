"""Where the GPU waits in a `torch.profiler` chrome trace (CPU and CUDA activities, `with_stack=True`): the idle
stretches between kernels, the largest first, each with the host's Python functions that ran across it and the CUDA
runtime calls inside it; each stretch's host time goes to the innermost function or operator running (a
`cudaStreamSynchronize` or `cudaEventSynchronize` there means the host waited for the GPU
before it could queue more).

    python bench/trace_gaps.py bench/results/h200/prefill_step_trace.json.gz --top 12
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plotting import read_json  # noqa: E402  (bench/plotting.py, beside this script)

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: Path) -> list[dict]:
    trace = read_json(path)
    return [e for e in trace.get("traceEvents", trace) if e.get("ph") == "X" and "dur" in e]


def busy_intervals(events: list[dict]) -> list[tuple[float, float]]:
    """The union of the GPU events' [start, end) intervals, in us, sorted."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATS)
    merged: list[list[float]] = []
    for s, t in spans:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], t)
        else:
            merged.append([s, t])
    return [(s, t) for s, t in merged]


def gaps(events: list[dict]) -> dict:
    """The GPU's idle time over the trace's span: before the first kernel, between kernels, after the last."""
    busy = busy_intervals(events)
    host = [e for e in events if e.get("cat") not in GPU_CATS]
    start = min(e["ts"] for e in host) if host else busy[0][0]
    end = max(e["ts"] + e["dur"] for e in host) if host else busy[-1][1]
    idle = [(start, busy[0][0], "before the first kernel")] if busy else []
    idle += [(a[1], b[0], "between kernels") for a, b in zip(busy, busy[1:])]
    if busy:
        idle.append((busy[-1][1], end, "after the last kernel"))
    return {"span_us": end - start, "busy_us": sum(t - s for s, t in busy), "idle": [g for g in idle if g[1] > g[0]],
            "host": host}


def inside(host: list[dict], s: float, t: float, cat: str) -> list[dict]:
    return [e for e in host if e.get("cat") == cat and e["ts"] < t and e["ts"] + e["dur"] > s]


def innermost_time(events: list[dict], s: float, t: float) -> dict[str, float]:
    """Each microsecond of [s, t) given to the innermost host event running then (the shortest of those that
    cover it: Python functions and operators nest), summed by name."""
    events = [e for e in events if e["ts"] < t and e["ts"] + e["dur"] > s]
    edges = sorted({s, t} | {max(s, e["ts"]) for e in events} | {min(t, e["ts"] + e["dur"]) for e in events})
    by: dict[str, float] = {}
    for a, b in zip(edges, edges[1:]):
        live = [e for e in events if e["ts"] <= a and e["ts"] + e["dur"] >= b]
        name = min(live, key=lambda e: e["dur"])["name"].split(" object at 0x")[0] if live else "(no host event)"
        by[name] = by.get(name, 0.0) + b - a
    return by


def describe(host: list[dict], s: float, t: float, depth: int = 6) -> list[str]:
    """What the host did across [s, t): the innermost Python function that covers all of it, then the innermost
    functions and operators that ran inside it, by their time there, and the CUDA runtime calls inside it."""
    lines = []
    py = inside(host, s, t, "python_function")
    covering = [e for e in py if e["ts"] <= s and e["ts"] + e["dur"] >= t]
    if covering:
        e = min(covering, key=lambda e: e["dur"])
        lines.append(f"      in  {e['name'][:100]}")
    leaves = innermost_time(py + inside(host, s, t, "cpu_op"), s, t)
    for name, us in sorted(leaves.items(), key=lambda kv: -kv[1])[:depth]:
        lines.append(f"      {us:8.0f} us  {name[:100]}")
    rt = inside(host, s, t, "cuda_runtime")
    by: dict[str, list[float]] = {}
    for e in rt:
        by.setdefault(e["name"], []).append(min(t, e["ts"] + e["dur"]) - max(s, e["ts"]))
    for name, us in sorted(by.items(), key=lambda kv: -sum(kv[1]))[:3]:
        lines.append(f"      {len(us):4d} x {name[:60]}: {sum(us):.0f} us")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=10, help="how many idle stretches to describe")
    p.add_argument("--min-us", type=float, default=50.0, help="idle stretches shorter than this are only summed")
    args = p.parse_args(argv)
    for path in args.traces:
        g = gaps(load(path))
        idle = g["idle"]
        total = sum(t - s for s, t, _ in idle)
        small = sum(t - s for s, t, _ in idle if t - s < args.min_us)
        print(f"=== {path.name}: {g['span_us'] / 1e3:.2f} ms traced, GPU busy {g['busy_us'] / 1e3:.2f} ms, idle "
              f"{total / 1e3:.2f} ms ({len(idle)} stretches; {small / 1e3:.2f} ms in those under {args.min_us:.0f} us)")
        for s, t, where in sorted(idle, key=lambda x: x[0] - x[1])[:args.top]:
            print(f"  {(t - s) / 1e3:7.2f} ms idle {where}, at +{(s - idle[0][0]) / 1e3:.2f} ms")
            print("\n".join(describe(g["host"], s, t)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
