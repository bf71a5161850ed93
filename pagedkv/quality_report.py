"""The `pagedkv eval` report as a text table and as a plot."""

from __future__ import annotations

import math


def _pct(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.0f}%"


def _increase(r: dict) -> str:
    se = r.get("ppl_increase_se_pct")
    return f"{r['ppl_increase_pct']:+.2f}%" + ("" if se is None else f" ± {se:.2f}")


def format_table(report: dict) -> str:
    """A Markdown table: one row per format."""
    results = report["formats"]
    lengths = sorted({int(n) for r in results.values() for n in r.get("passkey", {})})
    head = ["format", f"bytes/token/head (D={report['head_dim']})", "bytes/token/head (D=128)", "ppl",
            "ppl vs off (± s.e.)", "KL", "top-1"] + [f"passkey {n // 1024}K" if n % 1024 == 0 else f"passkey {n}"
                                             for n in lengths]
    rows = []
    for label, r in results.items():
        passkey = r.get("passkey", {})
        rows.append([f"`{label}`", f"{r['bytes_per_token_per_head']:.1f}".rstrip("0").rstrip("."),
                     f"{r['bytes_per_token_per_head_d128']:.1f}".rstrip("0").rstrip("."), f"{r['ppl']:.3f}",
                     _increase(r), f"{r['kl']:.5f}", f"{100 * r['top1']:.2f}%"]
                    + [_pct(passkey.get(str(n))) for n in lengths])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def format_profile_table(report: dict) -> str:
    """A Markdown table: per position bucket, each format's perplexity increase vs off (± s.e.) and KL."""
    results = report["formats"]
    profiled = {label: r["profile"] for label, r in results.items() if "profile" in r}
    if not profiled:
        return ""
    buckets = next(iter(profiled.values()))["buckets"]
    head = ["format"] + [f"{a}-{b}" for a, b in buckets]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    for label, prof in profiled.items():
        cells = [f"{i:+.2f}% ± {e:.2f}, KL {k:.4f}" for i, e, k in
                 zip(prof["ppl_increase_pct"], prof["ppl_increase_se_pct"], prof["kl"])]
        lines.append("| " + " | ".join([f"`{label}`"] + cells) + " |")
    return "\n".join(lines)


def write_plot(report: dict, path: str) -> None:
    """Three panels: perplexity increase and bytes per format, the increase by position, passkey accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pathlib import Path

    results = report["formats"]
    labels = list(results)
    color = {label: f"C{k % 10}" for k, label in enumerate(labels)}  # one colour per format in every panel
    fig, axes = plt.subplots(1, 3, figsize=(18, 6))

    ax = axes[0]
    y = list(range(len(labels)))
    inc = [results[label]["ppl_increase_pct"] for label in labels]
    se = [results[label].get("ppl_increase_se_pct") or 0.0 for label in labels]  # paired standard error
    bars = ax.barh(y, inc, xerr=se, capsize=3, color=[color[label] for label in labels])
    for bar, label, err in zip(bars, labels, se):
        b = results[label]["bytes_per_token_per_head"]
        ax.annotate(f" {b:.0f} B", (max(bar.get_width() + err, 0), bar.get_y() + bar.get_height() / 2), va="center",
                    fontsize=8)
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("perplexity increase vs off (%), bars: ± one standard error")
    ax.set_title(f"{report['scored_tokens']} scored tokens, window {report['window']}\n"
                 f"(bytes per token per KV head at head_dim {report['head_dim']})", fontsize=9)

    ax = axes[1]
    off = results[labels[0]].get("profile")
    for label in labels[1:]:
        prof = results[label].get("profile")
        if prof and off:
            mids = [(a + b) / 2 for a, b in prof["buckets"]]
            ax.errorbar(mids, prof["ppl_increase_pct"], yerr=prof["ppl_increase_se_pct"], marker="o", capsize=3,
                        color=color[label])
    ax.axhline(0, color="#888888", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("token position (bucket centre)")
    ax.set_ylabel("perplexity increase vs off in bucket (%), bars: ± one s.e.")
    ax.set_title(f"context profile ({report['profile_tokens']} tokens, one stretch of the text)", fontsize=9)

    ax = axes[2]
    lengths = sorted({int(n) for label in labels for n in results[label].get("passkey", {})})
    width = 0.8 / max(len(labels), 1)
    for k, label in enumerate(labels):
        pk = results[label].get("passkey") or {}
        xs = [i + (k - (len(labels) - 1) / 2) * width for i in range(len(lengths))]
        ax.bar(xs, [100 * pk.get(str(n), float("nan")) for n in lengths], width=width, label=label,
               color=color[label])
    ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths])
    ax.set_ylim(0, 105)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("passkey retrieval (%)")
    ax.set_title(f"passkey at depths {', '.join(f'{d:g}' for d in report['passkey_depths'])}", fontsize=9)
    handles, names = ax.get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=min(4, len(labels)), fontsize=8, frameon=False)

    fig.suptitle(f"pagedkv eval: {report['model']} on {Path(report['text']).name} ({report['device']}, "
                 f"{report['dtype']})", fontsize=11)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
