"""The engine's real `Scheduler` without a model: steps, preemptions and recomputed tokens of a workload, and
its time under a step-cost model fitted on an H200. It answers in a second what a same-memory GPU run answers in
twenty: which admission lookahead packs a workload best, and what the best one could reach.

Every step reserves the scheduled slots as the model runner does and appends one token to each sequence whose
computed tokens caught up; a step that does not fit preempts, as the engine does. Step time (`StepCost`):
a fixed part (the model's weights and small kernels), a part per decoding sequence (its attention and cache
write: per page format), and a part per prefilled token (recomputed prompts included). Fitted on the H200
same-memory runs of 2026-12-03 (8-layer Llama-3-8B shape, `bench/results/h200/engine_memory_sweep.json`): the
modelled tokens/s of its 15 runs are within 7.4% of the measured ones (mean +0.9%).

    python bench/scheduler_sim.py                       # the same-memory run, lookahead 0-1024, every format
    python bench/scheduler_sim.py --lookahead 512 640 --formats turboquant q4 --out bench/results/h200
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plotting  # noqa: E402  (bench/plotting.py, beside this script)

from pagedkv.cache import PagedKVCache  # noqa: E402
from pagedkv.engine.config import EngineConfig  # noqa: E402
from pagedkv.engine.sampling_params import SamplingParams  # noqa: E402
from pagedkv.engine.scheduler import Scheduler  # noqa: E402
from pagedkv.engine.sequence import Sequence  # noqa: E402
from pagedkv.errors import CacheCapacityError  # noqa: E402
from pagedkv.prefix import PrefixCache  # noqa: E402


@dataclass(frozen=True)
class StepCost:
    fixed_s: float = 2.3e-3          # a step's weights and small kernels (8-layer Llama-3-8B shape, H200)
    per_decode_s: float = 0.011e-3   # each decoding sequence at ~1,536 tokens of context
    per_prefill_token_s: float = 8e-6

    def __call__(self, num_decodes: int, num_prefill_tokens: int) -> float:
        return self.fixed_s + self.per_decode_s * num_decodes + self.per_prefill_token_s * num_prefill_tokens


# the per-sequence decode cost fitted per format on the same-memory run
FORMATS = {"off": StepCost(per_decode_s=0.016e-3), "turboquant": StepCost(), "q4": StepCost(per_decode_s=0.0078e-3)}
# the same-memory run's model: Llama-3-8B attention (8 KV heads, head_dim 128), 8 layers
NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS = 8, 128, 8


def page_bytes_per_token(fmt: str, num_kv_heads: int = NUM_KV_HEADS, head_dim: int = HEAD_DIM,
                         num_layers: int = NUM_LAYERS) -> int:
    """Bytes one token takes in `fmt` pages, all layers."""
    import torch

    from pagedkv.config import KVFormat
    from pagedkv.formats import make_format

    return make_format(KVFormat.parse(fmt), num_kv_heads, head_dim, torch.bfloat16, "cpu").bytes_per_token() * num_layers


def blocks_in(fmt: str, budget_bytes: int, block_size: int = 16) -> int:
    """Blocks of `fmt` pages at the same-memory run's shape that `budget_bytes` buys (2 GiB: `off` 4,096,
    TurboQuant 10,485, q4 15,420)."""
    return budget_bytes // (page_bytes_per_token(fmt) * block_size)


def make_scheduler(num_blocks: int, block_size: int = 16, **options) -> Scheduler:
    cache = PagedKVCache(num_blocks=num_blocks, block_size=block_size)
    return Scheduler(EngineConfig(prefix_caching=False, **options), cache, PrefixCache(cache, enabled=False))


def simulate(scheduler: Scheduler, requests, arrivals=None, cost: StepCost | None = None) -> dict:
    """Run `requests` [(prompt tokens, max_tokens or None, tokens it ends at)] through `scheduler`, arriving at the
    steps `arrivals` (all at once without). Returns preemptions, steps, tokens fed, the largest batch and, with
    `cost`, the modelled seconds."""
    seqs = []
    for i, (num_prompt, max_tokens, num_out) in enumerate(requests):
        params = SamplingParams(max_tokens=max_tokens if max_tokens is not None else 1000, ignore_eos=True)
        seqs.append((Sequence(str(i), i, [1 + i] * num_prompt, params, has_max_tokens=max_tokens is not None),
                     num_out))
    ends = {s.seq_id: n for s, n in seqs}
    pending, cache, steps, largest, fed, seconds = list(seqs), scheduler.cache, 0, 0, 0, 0.0
    while pending or scheduler.has_unfinished():
        while pending and (arrivals is None or arrivals[len(seqs) - len(pending)] <= steps):
            scheduler.add(pending.pop(0)[0])
        steps += 1
        assert steps < 1_000_000, "the scheduler stopped making progress"
        batch = scheduler.schedule()
        if not batch:
            continue
        try:
            cache.reserve([s.seq_id for s in batch.seqs], batch.num_new_tokens)
        except CacheCapacityError:  # what the engine does when a step does not fit after all
            scheduler.preempt_last()
            continue
        scheduler.after_step(batch)
        largest = max(largest, len(batch.seqs))
        fed += batch.num_tokens
        if cost is not None:
            decodes = sum(n == 1 for n in batch.num_new_tokens)
            seconds += cost(decodes, batch.num_tokens - decodes)
        for seq in batch.seqs:
            if seq.num_computed_tokens == len(seq.token_ids):
                seq.token_ids.append(7)
                if seq.num_output_tokens >= ends[seq.seq_id]:
                    seq.finish("length")
                    scheduler.finish(seq)
    assert cache.pool.num_used == 0 and not cache.seqs
    cache.pool.check()
    out = {"preemptions": scheduler.num_preemptions, "steps": steps, "tokens_fed": fed, "largest_batch": largest}
    if cost is not None:
        out["seconds"] = seconds
    return out


def plot(results: dict, path: Path) -> bool:
    plt = plotting.pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    colour = {fmt: f"C{i}" for i, fmt in enumerate(FORMATS)}
    for fmt, per in results["runs"].items():
        xs = sorted(int(k) for k in per)
        ax.plot(xs, [per[str(x)]["tokens_per_s"] for x in xs], color=colour[fmt], marker="o", label=f"{fmt} (model)")
    for fmt, points in results.get("measured", {}).items():
        if fmt in results["runs"]:
            ax.scatter([p[0] for p in points], [p[1] for p in points], color=colour[fmt], marker="x", s=40,
                       label=f"{fmt} (H200)")
    ax.set_xlabel("admission_lookahead_tokens")
    ax.set_ylabel("output tokens/s, higher is better")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, ncol=2)
    a = results["args"]
    ax.set_title(f"the real scheduler, modelled step costs: {a['requests']} requests x {a['prompt_tokens']} + "
                 f"{a['new_tokens']} tokens,\nthe same {a['same_memory']} GiB of pages per format (H200 fit)", fontsize=9)
    plotting.save(fig, path)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--lookahead", type=int, nargs="+", default=[0, 128, 256, 384, 512, 640, 768, 896, 1024])
    p.add_argument("--same-memory", type=float, default=2.0, metavar="GIB", help="every format's pages get GIB gibibytes")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--measured", default="bench/results/h200/engine_memory_sweep.json",
                   help="same-memory GPU runs to draw beside the model (skipped if missing)")
    p.add_argument("--out", default=None, help="folder for scheduler_sim.json and scheduler_sim.png")
    args = p.parse_args(argv)
    requests = [(args.prompt_tokens, args.new_tokens, args.new_tokens)] * args.requests
    results = {"args": vars(args), "runs": {}}
    print("| format | lookahead | steps | preemptions | tokens fed | modelled s | modelled output tokens/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for fmt in args.formats:
        num_blocks, cost = blocks_in(fmt, int(args.same_memory * 2**30)), FORMATS[fmt]
        results["runs"][fmt] = {}
        for lookahead in args.lookahead:
            start = time.perf_counter()
            scheduler = make_scheduler(num_blocks, max_num_batched_tokens=args.max_num_batched_tokens,
                                       admission_lookahead_tokens=lookahead, max_num_seqs=args.requests)
            r = simulate(scheduler, requests, cost=cost)
            r["tokens_per_s"] = args.requests * args.new_tokens / r["seconds"]
            results["runs"][fmt][str(lookahead)] = r
            print(f"| {fmt} | {lookahead} | {r['steps']} | {r['preemptions']} | {r['tokens_fed']} | {r['seconds']:.2f} | "
                  f"{r['tokens_per_s']:.0f} |  ({time.perf_counter() - start:.1f}s)", flush=True)
    measured = Path(args.measured)
    if measured.exists():
        results["measured"] = {}
        for r in json.loads(measured.read_text())["same_memory"].values():
            if not r.get("swap_on_preemption"):
                results["measured"].setdefault(r["format"], []).append((r["admission_lookahead_tokens"],
                                                                        r["tokens_per_s"]))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "scheduler_sim.json").write_text(json.dumps(results, indent=2))
        plot(results, out / "scheduler_sim.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
