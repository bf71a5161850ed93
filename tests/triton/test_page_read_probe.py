"""`bench/page_read_probe.py`, the read bound of a dense decode, reads what it claims: under the interpreter each
layout's sums (shuffled pages, pages in order, the contiguous cache) match a direct sum of the same keys and
values, so its GPU timings compare the same bytes."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_page_read_probe_sums_every_layout_right():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "page_read_probe.py"), "--tiny"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split() == ["pages", "shuffled:", "ok", "pages", "in", "order:", "ok", "contiguous:", "ok"], r.stdout
