"""Side by side on a GPU: decode time / SDPA bf16 under settings of the kernels that end a split decode
(`pagedkv/ops/triton/split_k.py`: programmatic dependent launch, the reduce's warps and channel shares, the window
kernel's pipeline), each setting timed twice in one process, alternating, with and without a dense recent window.

    python bench/split_end_probe.py --out bench/results/h200
    python bench/split_end_probe.py --settings '{"no PDL": {"PDL": false}, "PDL": {"PDL": true}}'
    python bench/split_end_probe.py --settings '{"16 ch": {"REDUCE_CHANNELS": 16}, "128 ch": {"REDUCE_CHANNELS": 128}}' \\
        --shapes 1x32768,2x16384 --formats "off;q8;q4;q6" --recent-tokens 0

A setting is a set of `split_k` module attributes, applied before its calls (kernels whose constexprs change compile
once). Writes split_end_probe.json and a plot of the first run of each setting.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernel_bench as kb  # noqa: E402
import plotting  # noqa: E402  (bench/plotting.py)
from pagedkv.ops.triton import split_k  # noqa: E402

DEFAULT_SETTINGS = '{"no PDL": {"PDL": false}, "PDL": {"PDL": true}}'


def probe(shapes, formats, settings: dict, recent_tokens: int, gen: torch.Generator) -> list[dict]:
    defaults = {name: getattr(split_k, name) for values in settings.values() for name in values}
    rows = []
    for num_seqs, seq_len in shapes:
        keys, values, queries, copies = kb.decode_inputs(num_seqs, seq_len)
        sdpa_ms = kb.sdpa_decode(keys, values, num_seqs, seq_len, queries, copies)[0]
        for spec in formats:
            layers, metas = kb.decode_copies(spec, keys, values, num_seqs, seq_len, gen)
            for window in (0,) if spec == "off" or not recent_tokens else (0, recent_tokens):
                calls = kb.decode_calls(layers, metas, queries, window, keys, values)
                times = {name: [] for name in settings}
                for _ in range(2):
                    for name, values_set in settings.items():
                        for attr, value in values_set.items():
                            setattr(split_k, attr, value)
                        times[name].append(kb.time_per_call(calls) / sdpa_ms)
                for attr, value in defaults.items():
                    setattr(split_k, attr, value)
                row = {"format": spec, "batch": num_seqs, "context": seq_len, "window": window,
                       "sdpa_us": sdpa_ms * 1e3, "time_vs_sdpa": times}
                rows.append(row)
                print(f"({num_seqs}, {seq_len}) {spec:26s} window {window:4d}  " + "  ".join(
                    f"{name} {t[0]:.3f} / {t[1]:.3f}" for name, t in times.items()) + f"  (SDPA {sdpa_ms * 1e3:.1f} us)",
                    flush=True)
                del calls
            del layers, metas
            torch.cuda.empty_cache()
        del keys, values, queries
        torch.cuda.empty_cache()
    return rows


def plot(rows: list[dict], settings: dict, path: Path) -> None:
    plt = plotting.pyplot()
    if plt is None or not rows:
        return
    labels = [f"{r['format'].replace('turboquant', 'tq')} {r['batch']}x{r['context']}" + (" w" if r["window"] else "")
              for r in rows]
    series = {name: [r["time_vs_sdpa"][name][0] for r in rows] for name in settings}
    fig, ax = plt.subplots(figsize=(max(8, 0.5 * len(rows)), 4.5))
    plotting.grouped_bars(ax, labels, series)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("decode time / SDPA bf16")
    ax.set_title("settings of the kernels that end a split decode (w: window of the recent tokens)")
    ax.tick_params(axis="x", labelrotation=70, labelsize=7)
    ax.legend()
    plotting.save(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--settings", default=DEFAULT_SETTINGS, help="JSON: name -> {split_k attribute: value}")
    p.add_argument("--shapes", default="1x32768,32x4096,64x8192,128x2048", help="batch x context, ','-separated")
    p.add_argument("--formats", default="off;q8;q4;turboquant;turboquant:k=q4_0,v=q4_0", help="';'-separated")
    p.add_argument("--recent-tokens", type=int, default=128, help="also with a dense recent window (0: never)")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()
    settings = json.loads(args.settings)
    for values in settings.values():
        for attr in values:
            if not hasattr(split_k, attr):
                p.error(f"split_k has no setting {attr!r}")
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    rows = probe(shapes, args.formats.split(";"), settings, args.recent_tokens, torch.Generator().manual_seed(0))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "split_end_probe.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
    plot(rows, settings, out / "split_end_probe.png")


if __name__ == "__main__":
    main()
