"""How long a decode step's programs take, in a list-scheduling model, for batches whose sequences differ in
length: programs start in launch order on a fixed number of resident slots, each lasting its keys plus a fixed
overhead; printed as the step's time over a perfectly balanced step's. Compares one split in grid order (the
default at large batches), more splits in grid order (split slowest), and more splits launched longest sequence
first, a token's programs together (`metadata.LONGEST_FIRST`). A model, not a measurement: it ignores that the
programs left at the end of a step may read faster; `bench/gluon_probe.py` with SPREAD measures.

    python bench/launch_order_sim.py
    python bench/launch_order_sim.py --batch 96 --slots 1056 --lengths 1024-2048 128-8192
"""

from __future__ import annotations

import argparse
import heapq
import random


def makespan(durations: list[float], slots: int) -> float:
    """When the last program ends, each taking the first free slot in launch order."""
    free = [0.0] * slots
    for d in durations:
        heapq.heappush(free, heapq.heappop(free) + d)
    return max(free)


def programs(lens: list[int], heads: int, splits: int, overhead: float, longest_first: bool) -> list[float]:
    """Durations in launch order: grid (tokens, heads, splits), or (heads, splits, tokens) longest first."""
    def part(n, s):
        chunk = -(-n // splits)
        return max(0, min(n, (s + 1) * chunk) - s * chunk) + overhead
    if longest_first:
        return [part(n, s) for n in sorted(lens, reverse=True) for _ in range(heads) for s in range(splits)]
    return [part(n, s) for s in range(splits) for _ in range(heads) for n in lens]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--heads", type=int, default=8, help="programs a token per split (KV heads)")
    p.add_argument("--slots", type=int, default=1056, help="resident programs (8 a multiprocessor x 132)")
    p.add_argument("--overhead", type=float, default=48.0, help="a program's fixed cost, in keys")
    p.add_argument("--lengths", nargs="+", default=["1536-1536", "1024-2048", "256-4096", "128-8192"],
                   help="LOW-HIGH: lengths drawn uniformly from LOW to HIGH")
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 3, 4])
    args = p.parse_args(argv)
    rng = random.Random(0)
    print(f"batch {args.batch}, {args.heads} programs a token and split, {args.slots} slots: step time / balanced")
    print("| lengths | " + " | ".join(f"{s} split{'s' * (s > 1)}, grid / longest first" for s in args.splits) + " |")
    print("| --- " * (len(args.splits) + 1) + "|")
    for spec in args.lengths:
        low, high = (int(x) for x in spec.split("-"))
        lens = [rng.randint(low, high) for _ in range(args.batch)]
        balanced = sum(lens) * args.heads / args.slots
        cells = [f"{makespan(programs(lens, args.heads, s, args.overhead, False), args.slots) / balanced:.2f} / "
                 f"{makespan(programs(lens, args.heads, s, args.overhead, True), args.slots) / balanced:.2f}"
                 for s in args.splits]
        print(f"| {spec} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
