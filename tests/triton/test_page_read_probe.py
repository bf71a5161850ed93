"""`bench/page_read_probe.py`, the read bound of a dense decode, reads what it claims: each layout's sums (shuffled
pages, pages in order, the contiguous cache) match a direct sum of the same keys and values, so its GPU timings
compare the same bytes."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import page_read_probe  # noqa: E402
from triton_cases import DEVICE  # noqa: E402


def test_the_page_read_probe_sums_every_layout_right():
    assert page_read_probe.check_layouts(DEVICE) == ["pages shuffled", "pages in order", "contiguous"]
