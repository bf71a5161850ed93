"""Where a same-memory run's time went, step by step, from the timeline `bench/engine_gpu.py --same-memory` writes
(one row per engine step: seconds, running, waiting, blocks used, CUDA graph replays, preemptions): per format, the
steps that replayed a decode graph (count, median and total time), the others (admissions, prefill, mixed and eager
steps), the decode-graph steps' median by batch size (`--bins`: a batch padded to a larger CUDA graph bucket costs
what the bucket costs), and the slowest steps with what changed in them. A step far slower than its kind (a kernel
compiled mid-stream, a stall) shows at the top of the list.

    python bench/engine_steps.py bench/results/h200/engine_memory_compiled.json.gz [--slowest 5] [--bins 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plotting import read_json  # noqa: E402  (bench/plotting.py, beside this script)


def steps(rows: list[list[float]]) -> list[dict]:
    """One dict per step: its duration (ms) and what changed in it."""
    return [{"step": i, "at_s": t, "ms": 1e3 * (t - prev[0]), "batch": prev[1], "running": running,
             "admitted": prev[2] - waiting, "replayed": replays > prev[4], "preempted": preemptions - prev[5]}
            for i, (prev, (t, running, waiting, _, replays, preemptions)) in enumerate(zip(rows, rows[1:]), start=1)]


def by_batch(graph: list[dict], width: int, min_steps: int = 20) -> str:
    """The median (ms) of decode-graph steps `graph` per bin of `width` batch sizes (the sequences running into
    the step), bins of at least `min_steps` steps."""
    bins: dict[int, list[float]] = {}
    for x in graph:
        bins.setdefault((x["batch"] - 1) // width, []).append(x["ms"])
    return ", ".join(f"{b * width + 1}-{(b + 1) * width}: {statistics.median(v):.2f} ({len(v)})"
                     for b, v in sorted(bins.items()) if len(v) >= min_steps)


def summary(name: str, rows: list[list[float]], slowest: int, width: int = 8) -> list[str]:
    s = steps(rows)
    graph = [x for x in s if x["replayed"] and x["admitted"] == 0]   # decode steps replaying a CUDA graph
    ms = [x["ms"] for x in graph]
    other_s = (sum(x["ms"] for x in s) - sum(ms)) / 1e3
    lines = [f"{name}: {len(s)} steps, {sum(x['ms'] for x in s) / 1e3:.2f} s; decode graph replays {len(graph)} "
             f"(median {statistics.median(ms) if ms else float('nan'):.2f} ms, {sum(ms) / 1e3:.2f} s); "
             f"other steps {len(s) - len(graph)} ({other_s:.2f} s)",
             f"    decode-graph step median by batch, ms (steps): {by_batch(graph, width)}"]
    for x in sorted(s, key=lambda x: -x["ms"])[:slowest]:
        lines.append(f"    step {x['step']:>5} at {x['at_s']:7.3f} s: {x['ms']:8.1f} ms, {x['running']} running, "
                     f"{x['admitted']:+d} admitted, {x['preempted']} preempted, "
                     f"{'graph replay' if x['replayed'] else 'eager'}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="engine_gpu.py JSON files with same-memory timelines")
    p.add_argument("--slowest", type=int, default=5, help="slowest steps listed per format")
    p.add_argument("--bins", type=int, default=8, help="batch sizes per bin of the decode-graph step medians")
    args = p.parse_args(argv)
    for path in args.runs:
        run = read_json(path)
        print(f"== {path}")
        for name, r in (run.get("same_memory") or {}).items():
            rows = r.get("timeline", {}).get("rows")
            if rows:
                print("\n".join(summary(name, rows, args.slowest, args.bins)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
