"""What the benchmark scripts' plots share: matplotlib without a display, grouped bars, saving a figure, and reading
the results they plot (`read_json`: stored results over ~400 KB are kept gzipped, as `NAME.json.gz`)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path


def read_json(path) -> dict:
    """A results file: JSON, or gzipped JSON when its name ends in .gz."""
    path = Path(path)
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed (then no plot)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def grouped_bars(ax, categories: list[str], series: dict[str, list[float]], horizontal: bool = False,
                 **bar_options) -> list:
    """One group of bars per category, one bar per series (colour Ci for the i-th); returns the bar
    containers. `horizontal`: groups top to bottom."""
    width = 0.8 / len(series)
    draw = ax.barh if horizontal else ax.bar
    containers = []
    for i, (label, values) in enumerate(series.items()):
        xs = [j + i * width for j in range(len(categories))]
        containers.append(draw(xs, values, width, label=label, color=f"C{i}", **bar_options))
    ticks = [j + 0.4 - width / 2 for j in range(len(categories))]
    if horizontal:
        ax.set_yticks(ticks, categories)
        ax.invert_yaxis()
    else:
        ax.set_xticks(ticks, categories)
    return containers


def save(fig, path: Path | str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
