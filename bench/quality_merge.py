"""Merge `pagedkv eval` reports measured in separate runs into one report, table and plot.

    python bench/quality_merge.py A.json B.json ... --json OUT.json --plot OUT.png

A long evaluation (every format, each with an 8K context profile) is run in parts: on a lent GPU whose
calls are limited in time, or a few formats at a time on a CPU. Each part measures `off` first, so
every format's increase and KL are against `off` of its own run. The parts must agree on what was
measured (model, text, dtype, windows, profile length); a format measured twice is taken from the first
report that has it. Each merged format records the report it came from (`source`) and its device.
Passkeys are kept only when every part measured them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagedkv.quality_report import format_profile_table, format_table, write_plot  # noqa: E402

SAME = ("model", "dtype", "window", "num_windows", "scored_tokens", "head_dim", "num_layers", "profile_tokens")


def merge(reports: list[tuple[str, dict]]) -> dict:
    """[(name, report)] -> one report holding every format once, in order of first appearance."""
    first_name, first = reports[0]
    merged = {k: v for k, v in first.items() if k not in ("formats", "command", "seconds")}
    merged.update(formats={}, sources={}, complete=all(r.get("complete", False) for _, r in reports))
    for name, report in reports:
        for key in SAME:
            if report.get(key) != first.get(key):
                raise SystemExit(f"{name}: {key} = {report.get(key)!r}, but {first_name} has {first.get(key)!r}; "
                                 "merge only reports of the same measurement")
        if Path(report["text"]).name != Path(first["text"]).name:
            raise SystemExit(f"{name} measured {report['text']}, {first_name} {first['text']}")
        if next(iter(report["formats"]), None) != "off":
            raise SystemExit(f"{name}: its first format must be off (the increases are against it)")
        merged["sources"][name] = {"device": report["device"], "command": report.get("command")}
        for label, result in report["formats"].items():
            if label not in merged["formats"]:
                merged["formats"][label] = {**result, "source": name, "device": report["device"]}
    if not all("passkey" in r for r in merged["formats"].values()):  # a partial panel would read as misses
        for r in merged["formats"].values():
            r.pop("passkey", None)
            r.pop("passkey_by_depth", None)
        merged["note"] = "passkeys left out: not every part measured them"
    devices = sorted({s["device"] for s in merged["sources"].values()})
    merged["device"] = " + ".join(devices)
    return merged


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("reports", nargs="+", help="`pagedkv eval --json` reports, each with off first")
    p.add_argument("--json", required=True, help="merged report")
    p.add_argument("--plot", default=None, help="plot of the merged report (PNG)")
    args = p.parse_args(argv)
    merged = merge([(Path(r).name, json.loads(Path(r).read_text())) for r in args.reports])
    Path(args.json).write_text(json.dumps(merged, indent=2) + "\n")
    print(format_table(merged))
    profile = format_profile_table(merged)
    if profile:
        print(f"\ncontext profile: perplexity increase vs off (± s.e.) and KL per position bucket\n{profile}")
    if args.plot:
        write_plot(merged, args.plot)
    print(f"wrote {args.json}" + (f" and {args.plot}" if args.plot else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
