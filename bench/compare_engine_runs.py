"""Output tokens/s of `bench/engine_gpu.py` runs side by side, per page format: two or more JSON files of the same
kind (`engine_memory.json` of a same-memory run, or `engine_gpu.json` of a decode run at one batch), each with a
label; prints a table (ratios against the first run) and draws grouped bars.

    python bench/compare_engine_runs.py --out bench/results/h200/engine_compile_memory.png \
        "eager layers=bench/results/h200/engine_memory_eager_layers.json.gz" \
        "compiled layers=bench/results/h200/engine_memory_compiled.json.gz"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plotting import grouped_bars, pyplot, read_json, save  # noqa: E402


def tokens_per_s(run: dict, batch: str | None) -> dict[str, float]:
    """{format: output tokens/s} of one run: the same-memory run's, else the decode's at `batch` (CUDA graphs)."""
    if run.get("same_memory"):
        return {fmt: r["tokens_per_s"] for fmt, r in run["same_memory"].items()}
    return {fmt: r["decode"][batch]["tokens_per_s"] for fmt, r in run["pagedkv"].items() if batch in r["decode"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="LABEL=JSON")
    p.add_argument("--batch", default=None, help="decode runs: the batch to compare (default: the first run's largest)")
    p.add_argument("--out", default=None, help="PNG path for the plot")
    args = p.parse_args(argv)
    labelled = []
    for item in args.runs:
        label, sep, path = item.partition("=")
        if not sep:
            p.error(f"{item!r}: give LABEL=PATH")
        labelled.append((label, read_json(path)))
    first = labelled[0][1]
    batch = args.batch or (None if first.get("same_memory") else str(max(first["args"]["batches"])))
    values = {label: tokens_per_s(run, batch) for label, run in labelled}
    formats = [f for f in values[labelled[0][0]] if all(f in v for v in values.values())]
    what = "same-memory run" if batch is None else f"decode at batch {batch}, {first['args']['context']} tokens"
    print(f"output tokens/s, {what} ({first.get('gpu', '?')})")
    print("| format | " + " | ".join(label for label, _ in labelled) + " |")
    print("| --- " * (len(labelled) + 1) + "|")
    base = labelled[0][0]
    for f in formats:
        cells = [f"{values[label][f]:,.0f}" + ("" if label == base else f" ({values[label][f] / values[base][f]:.2f}x)")
                 for label, _ in labelled]
        print(f"| {f} | " + " | ".join(cells) + " |")
    plt = pyplot()
    if args.out and plt is not None:
        fig, ax = plt.subplots(figsize=(7, 4))
        grouped_bars(ax, formats, {label: [values[label][f] for f in formats] for label, _ in labelled})
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{what}, {first.get('gpu', '')}")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2)   # below: bars stay clear
        save(fig, args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
