"""Where a kernel's warps stall and which instructions waste shared-memory or L2 traffic, from the per-instruction
CSV that `bash bench/h200_run.sh ncu-source` writes (`ncu --import REPORT --page source --csv --print-source sass`).

    python bench/ncu_summary.py bench/results/h200/ncu/ncu_src_turboquant_sass.csv [--top 15]

Prints the stall reasons over all samples, the shared-memory wavefronts and L2 sectors against their ideal, the
instructions that take the most samples, and the instructions whose shared or L2 traffic exceeds its ideal by more
than 0.2% of the kernel's.
"""
import argparse
import csv
from pathlib import Path


def number(text: str) -> int:
    try:
        return int(text.replace(",", ""))
    except ValueError:
        return 0


def load(path: Path) -> list[dict]:
    rows = list(csv.reader(path.open()))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    header = rows[start]
    return [dict(zip(header, r)) for r in rows[start + 1:] if len(r) == len(header)]


def summary(rows: list[dict], top: int) -> str:
    stalls = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    samples = sum(number(r["Warp Stall Sampling (All Samples)"]) for r in rows) or 1
    out = [f"{samples} stall samples over {len(rows)} instructions"]
    totals = {k: sum(number(r[k]) for r in rows) for k in stalls}
    for k, v in sorted(totals.items(), key=lambda kv: -kv[1]):
        if v:
            out.append(f"  {k[6:]:20s} {v:8d}  {100 * v / samples:5.1f}%")

    shared, l2 = "L1 Wavefronts Shared", "L2 Theoretical Sectors Global"
    totals = {name: sum(number(r[name]) for r in rows) for name in (shared, l2)}
    for label, name in (("shared-memory wavefronts", shared), ("L2 sectors (global)", l2)):
        ideal = sum(number(r[name + " Ideal"]) for r in rows)
        out.append(f"{label}: {totals[name]:,} for {ideal:,} ideal ({totals[name] / max(ideal, 1):.2f}x)")
    out.append(f"the {top} instructions with the most samples (address, SASS, samples, top stalls):")
    for r in sorted(rows, key=lambda r: -number(r["Warp Stall Sampling (All Samples)"]))[:top]:
        top3 = sorted(((number(r[k]), k[6:]) for k in stalls), reverse=True)[:3]
        out.append(f"  {r['Address'][-5:]} {r['Source'].strip()[:56]:56s} {r['Warp Stall Sampling (All Samples)']:>6s}  "
                   + ", ".join(f"{k} {v}" for v, k in top3 if v))
    out.append("instructions whose traffic exceeds its ideal by 0.2% of the kernel's (shared wavefronts / ideal, "
               "L2 sectors / ideal):")
    for r in rows:
        got = {name: (number(r[name]), number(r[name + " Ideal"])) for name in (shared, l2)}
        if any(n - ideal > 0.002 * totals[name] for name, (n, ideal) in got.items()):
            (sh, sh_ideal), (l2n, l2_ideal) = got[shared], got[l2]
            out.append(f"  {r['Address'][-5:]} {r['Source'].strip()[:56]:56s} shared {sh:>10,} / {sh_ideal:<10,} "
                       f"L2 {l2n:>10,} / {l2_ideal:,}")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("csv", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    for path in args.csv:
        print(f"== {path}")
        print(summary(load(path), args.top))


if __name__ == "__main__":
    main()
