"""On a GPU: the engine's batch-64 decode step split into host work and waiting for the GPU.

The window of bench/engine_gpu.py (8-layer Llama-3-8B-shaped model, `--format` pages, 64 requests of 4,096
prompt tokens, 3 warm-up and 64 timed decode steps; the first-prefilled requests finish in the window),
run twice on fresh engines: untimed, then with the engine's phases timed as bench/engine_host.py does.
"Wait" is the time spent in `torch.cuda.Event.synchronize` (the host reading a step's tokens); the rest
of a step is host work. Also times the graph replay alone (bench/engine_gpu.py's profile_replay).

    python bench/engine_gpu_host.py LABEL [BATCH ...] [--format F]   # writes $OUT/probe_LABEL.json (default /tmp/out)

`--format` picks the page format (default `off`): TurboQuant's batch-64 engine step is 1.1 ms longer than
its graph replay, against 0.37 ms for bf16 pages (BENCHMARKS.md), and this splits that gap.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import engine_gpu as eg  # noqa: E402
import engine_host as eh  # noqa: E402
from pagedkv import LLM, SamplingParams  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("label")
parser.add_argument("batches", type=int, nargs="*", default=[64])
parser.add_argument("--format", default="off", help="page format, as --paged-kv-quantization takes it")
args = parser.parse_args()
label, batches = args.label, args.batches
model = eg.build_model(8)
wait = {"s": 0.0}
orig_sync = torch.cuda.Event.synchronize


def timed_sync(self):
    t = time.perf_counter()
    orig_sync(self)
    wait["s"] += time.perf_counter() - t


torch.cuda.Event.synchronize = timed_sync
out = {}
for batch in batches:
    context, warm, steps = 4096, 3, 64
    res = {}
    for timed in (False, True):
        blocks_per_seq = -(-(context + 64 + 8 + 32) // 16)
        llm = LLM(model, kv_format=args.format, num_blocks=64 * blocks_per_seq + 64, max_num_seqs=64, max_num_batched_tokens=16384)
        e = llm.engine
        prompts = eg.random_prompts(batch, context, e.vocab_size, seed=batch)
        params = SamplingParams(max_tokens=warm + steps + 10, ignore_eos=True)
        seqs = [e.requests[e.add_request(p, params)] for p in prompts]
        while any(s.num_output_tokens == 0 for s in seqs):
            e.step()
        for _ in range(warm):
            e.step()
        torch.cuda.synchronize()
        totals = {}
        undo = eh.instrument(e, totals) if timed else []
        step_ms, wait_ms, fin = [], [], []
        for _ in range(steps):
            n, w0 = e.num_finished, wait["s"]
            t = time.perf_counter()
            e.step()
            step_ms.append((time.perf_counter() - t) * 1e3)
            wait_ms.append((wait["s"] - w0) * 1e3)
            fin.append(e.num_finished - n)
        torch.cuda.synchronize()
        for o, name in undo:
            delattr(o, name)
        r = {"step_ms_mean": statistics.fmean(step_ms), "wait_ms_mean": statistics.fmean(wait_ms),
             "host_ms_mean": statistics.fmean(a - b for a, b in zip(step_ms, wait_ms)),
             "steady_step_ms": statistics.fmean([a for a, f in zip(step_ms, fin) if f == 0] or [0]),
             "steady_host_ms": statistics.fmean([a - b for a, b, f in zip(step_ms, wait_ms, fin) if f == 0] or [0]),
             "finish_step_host_ms": [round(a - b, 3) for a, b, f in zip(step_ms, wait_ms, fin) if f],
             "finished": sum(fin), "ahead": e.num_steps_ahead, "step_ms": [round(x, 3) for x in step_ms],
             "wait_ms": [round(x, 3) for x in wait_ms]}
        if timed:
            r["phases_us"] = {k: v / steps * 1e6 for k, v in totals.items()}
        else:
            r.update(eg.profile_replay(e.runner.graphs, batch, replays=20))
        res["timed" if timed else "plain"] = r
        print(label, batch, "timed" if timed else "plain", {k: v for k, v in r.items() if k not in ("step_ms", "wait_ms")}, flush=True)
        while e.has_unfinished():
            e.step()
        del llm, e, seqs
        eg.free_memory()
    out[batch] = res
out["format"] = args.format
os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp/out"), f"probe_{label}.json"), "w"), indent=1)
