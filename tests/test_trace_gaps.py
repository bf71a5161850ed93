"""bench/trace_gaps.py: the GPU's idle stretches in a chrome trace, and the host work that ran across each."""

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import trace_gaps  # noqa: E402  (bench/trace_gaps.py)


def event(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_idle_stretches_and_the_innermost_host_work_in_them(tmp_path, capsys):
    events = [
        event("python_function", "engine.py(1): step", 0, 1000),
        event("python_function", "scheduler.py(2): schedule", 10, 300),    # the GPU waits for it
        event("python_function", "prefix.py(3): hash_block", 20, 200),     # inside schedule
        event("cuda_runtime", "cudaMemcpyAsync", 320, 5),
        event("kernel", "gemm", 350, 200),
        event("kernel", "silu", 540, 100),                                 # overlaps the gemm: one busy stretch
        event("cuda_runtime", "cudaEventSynchronize", 650, 340),
        event("kernel", "argmax", 700, 50),
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    g = trace_gaps.gaps(trace_gaps.load(path))
    assert g["busy_us"] == 290 + 50 and g["span_us"] == 1000
    assert [(s, t, where) for s, t, where in g["idle"]] == [
        (0, 350, "before the first kernel"), (640, 700, "between kernels"), (750, 1000, "after the last kernel")]
    host = trace_gaps.innermost_time(g["host"], 0, 350)
    assert host["prefix.py(3): hash_block"] == 200 and host["scheduler.py(2): schedule"] == 100
    assert trace_gaps.main([str(path), "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "idle 0.66 ms" in out and "0.35 ms idle before the first kernel" in out and "hash_block" in out
