"""Quality of each page format on the default model: `pagedkv eval` with the README's settings.

    python bench/quality.py [extra `pagedkv eval` options]

Perplexity over 2,048-token windows of Pride and Prejudice (8,192 tokens, 4,096 scored), KL divergence
and top-1 agreement against dense pages, the context profile up to 8K tokens and passkey retrieval at
1K-8K. Writes bench/results/quality.json and bench/results/quality.png. Options given on the command
line are appended and win (e.g. `--formats off,q8`).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pagedkv.cli import main  # noqa: E402

TEXT = ROOT.parent / "shared" / "data" / "pride-and-prejudice.txt"
FORMATS = ("off,q8,turboquant,turboquant:k=q8_0,v=q4_0,turboquant:k=q4_0,v=q4_0,"
           "turboquant:k=q4_0,v=q4_0,rotate_keys,turboquant:k=q4_0,v=q4_0,rotate_keys,boundary_layers=2")


def default_args() -> list[str]:
    out = ROOT / "bench" / "results"
    return ["eval", "--model", "default", "--text", str(TEXT), "--formats", FORMATS, "--window", "2048",
            "--max-tokens", "8192", "--passkey-lengths", "1k,2k,4k,8k", "--passkey-depths", "0.5",
            "--json", str(out / "quality.json"), "--plot", str(out / "quality.png")]


if __name__ == "__main__":
    sys.exit(main(default_args() + sys.argv[1:]))
