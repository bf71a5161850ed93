"""bench/tensor_parallel.py end to end on CPU ranks with a tiny model: it measures both configurations through
the engine, compares their greedy outputs, and writes its JSON and plot (so the GPU run is known to work)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import tensor_parallel  # noqa: E402


def test_bench_measures_one_and_two_ranks_and_compares_their_outputs(tmp_path, capsys):
    out = tmp_path / "out"
    assert tensor_parallel.main(["--device", "cpu", "--shape", "tiny", "--layers", "1", "--ranks", "1", "2",
                                 "--batches", "2", "--context", "16", "--decode-steps", "2", "--warm-steps", "1",
                                 "--requests", "2", "--prompt-tokens", "12", "--new-tokens", "4",
                                 "--model-dir", str(tmp_path / "model"), "--out", str(out)]) == 0
    results = json.loads((out / "tensor_parallel.json").read_text())
    first, second = results["runs"]
    assert (first["ranks"], second["ranks"]) == (1, 2)
    for run in results["runs"]:
        assert run["decode"]["2"]["tokens_per_s"] > 0 and run["generate"]["output_tokens"] == 8
    assert second["agreement_with_first"] == {"identical_requests": 2, "requests": 2,
                                              "tokens_before_first_difference": 1.0}
    assert second["kv_bytes_per_rank"] * 2 == first["kv_bytes_per_rank"]  # each of 2 ranks holds half the heads
    printed = capsys.readouterr().out
    assert "| 2 ranks (cpu) |" in printed and "2/2 requests identical" in printed
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "tensor_parallel.png").stat().st_size > 10_000
