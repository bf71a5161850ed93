"""The all-reduce of a tensor-parallel decode step, by implementation: what one costs on N GPUs of one host.

A row-parallel layer ends with an all-reduce of the hidden states, [batch, hidden] bf16, twice per
transformer layer. Decode batches are small (16-256 rows of 4,096: 128 KiB-2 MiB), where a collective's
latency, not the link's bandwidth, sets its time. This compares, each captured in a CUDA graph as the
engine replays them and timed over many back-to-back calls:

  nccl       torch.distributed.all_reduce (NCCL; NVLink multicast stays off)
  one_shot   torch.ops.symm_mem.one_shot_all_reduce: every rank reads every peer's buffer over P2P
  two_shot   torch.ops.symm_mem.two_shot_all_reduce_: reduce-scatter then all-gather over P2P

    python bench/allreduce.py --ranks 2 --rows 16 64 256 --out bench/results

Prints a table (microseconds per all-reduce, medians) and writes allreduce.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)  # multicast stays off (it can take a shared host's GPUs down)


def _time_graph(fn, calls: int, repeats: int) -> float:
    """Microseconds per call of `fn`, `calls` of them captured in one CUDA graph, median over `repeats` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def _rank(rank: int, world: int, port: int, rows: list[int], hidden: int, calls: int, repeats: int, result: str):
    import torch.distributed._symmetric_memory as symm_mem

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    out = {}
    for n in rows:
        row = out.setdefault(n, {})
        x = torch.full((n, hidden), float(rank + 1), device="cuda", dtype=torch.bfloat16)
        want = float(sum(range(1, world + 1)))
        ways = {"nccl": lambda: dist.all_reduce(x)}
        try:
            buf = symm_mem.empty((n, hidden), dtype=torch.bfloat16, device="cuda")
            symm_mem.rendezvous(buf, group)
            buf.fill_(float(rank + 1))
            name = group.group_name
            ways["one_shot"] = lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", name)
            ways["two_shot"] = lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", name)
        except Exception as exc:  # noqa: BLE001 - report what this build lacks, time the rest
            row["symm_mem_error"] = f"{type(exc).__name__}: {exc}"[:300]
        for way, fn in ways.items():
            try:
                if way == "one_shot":  # check the sum once (the in-place ways grow their input as they repeat)
                    buf.fill_(float(rank + 1))
                    got = fn()
                    torch.cuda.synchronize()
                    if not torch.all(got == want):
                        raise AssertionError(f"one_shot summed to {got.flatten()[0].item()}, not {want}")
                row[way] = _time_graph(fn, calls, repeats)
            except Exception as exc:  # noqa: BLE001
                row[way] = f"{type(exc).__name__}: {exc}"[:300]
    if rank == 0:
        Path(result).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256], help="decode batch sizes")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--calls", type=int, default=64, help="all-reduces per captured graph")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if torch.cuda.device_count() < args.ranks:
        print(f"needs {args.ranks} CUDA devices, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = Path(args.out or ".") / "allreduce.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    mp.spawn(_rank, args=(args.ranks, port, args.rows, args.hidden, args.calls, args.repeats, str(result)),
             nprocs=args.ranks)
    data = json.loads(result.read_text())
    ways = ["nccl", "one_shot", "two_shot"]
    print(f"{torch.cuda.get_device_name(0)} x{args.ranks}: us per all-reduce of [rows, {args.hidden}] bf16, "
          f"in a CUDA graph, median of {args.repeats} x {args.calls}")
    print("| rows | KiB | " + " | ".join(ways) + " |")
    print("| ---: | ---: | " + " | ".join("---:" for _ in ways) + " |")
    for n, row in data.items():
        cells = [f"{row[w]:.1f}" if isinstance(row.get(w), float) else "-" for w in ways]
        print(f"| {n} | {int(n) * args.hidden * 2 // 1024} | " + " | ".join(cells) + " |")
        for w in ways + ["symm_mem_error"]:
            if isinstance(row.get(w), str):
                print(f"  {n} rows, {w}: {row[w]}")
    result.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "ranks": args.ranks, "hidden": args.hidden,
                                  "us_per_all_reduce": data}, indent=1))
    print(f"wrote {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
