"""The engine's real `Scheduler` without a model: steps, preemptions and recomputed tokens of a workload, and
its time under a step-cost model fitted on an H200. It answers in a second what a same-memory GPU run answers in
twenty: which admission lookahead packs a workload best, and how fast a format's decode kernel must read its pages
for a given ratio to `off`.

Every step reserves the scheduled slots as the model runner does and appends one token to each sequence whose
computed tokens caught up; a step that does not fit preempts, as the engine does. Step time (`StepCost`): a fixed
part (the model's weights and small kernels), a part per decoding sequence, the decode kernel's read of every
decoding sequence's pages (bytes per token / the format's read rate, `RATES`), and a part per prefilled token
(recomputed prompts included). Fitted on the H200 same-memory run of 2026-12-06 (8-layer Llama-3-8B shape,
`bench/results/h200/engine_memory_session42.json.gz`; the read rates are session 33's kernels at the run's batches
and 1,536 tokens): at lookahead 640 the model takes the run's steps and preemptions (`off` 7,172 and 42 against 7,178
and 42; TurboQuant 3,079 and 36 against 3,081 and 36; q4 2,057 and 26 against 2,058 and 26) and gives 15,426, 28,747
and 39,754 output tokens/s against 15,075, 27,919 and 37,520 measured (+2.3%, +3.0%, +6.0%).

    python bench/scheduler_sim.py                       # the same-memory run, lookahead 0-1024, every format
    python bench/scheduler_sim.py --lookahead 512 640 --formats turboquant q4 --out bench/results/h200
    python bench/scheduler_sim.py --lookahead 640 --rate turboquant=3.0 --rate q4=3.0   # faster decode kernels
    python bench/scheduler_sim.py --lookahead 640 --roofline --max-num-batched-tokens 256 --mixed-step-ms 5
    python bench/scheduler_sim.py --lookahead 640 --roofline --max-num-batched-tokens 320 --mixed-graph-tokens 320
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
    fixed_s: float = 1.62e-3          # a step's weights and small kernels (8-layer Llama-3-8B shape, H200)
    per_decode_s: float = 0.6e-6      # each decoding sequence (the matrix products' rows, sampling)
    per_context_token_s: float = 0.0  # the decode kernel's read of one token of a decoding sequence's pages
    per_prefill_token_s: float = 5.8e-6
    # roofline: the matrix products take the longer of the weights' read (weights_s) and their arithmetic
    # (per_prefill_token_s a row, decodes and prompt tokens alike) on top of other_s, so that prompt tokens ride
    # along a decode step's rows for free up to ~250; mixed_floor_s: a step holding prompt tokens takes at least
    # this long (an eager step's host time: only decode steps replay CUDA graphs)
    roofline: bool = False
    weights_s: float = 1.45e-3
    other_s: float = 0.2e-3
    mixed_floor_s: float = 0.0
    # mixed CUDA graphs (`EngineConfig.cuda_graph_mixed_tokens`): a step holding prompt tokens computes at least this
    # many rows (its graph's padded chunk rows; a bucket's decodes plus the chunk rows a step of this many can add)
    mixed_rows: int = 0

    def __call__(self, num_decodes: int, num_prefill_tokens: int, num_context_tokens: int = 0) -> float:
        attention = self.per_context_token_s * num_context_tokens
        rows = num_decodes + num_prefill_tokens
        if num_prefill_tokens:
            rows = max(rows, self.mixed_rows)
        if self.roofline:
            t = self.other_s + max(self.weights_s, self.per_prefill_token_s * rows)
        else:
            t = self.fixed_s + self.per_decode_s * num_decodes + self.per_prefill_token_s * num_prefill_tokens
        t += attention
        return max(t, self.mixed_floor_s) if num_prefill_tokens else t


# the rate (TB/s) each format's decode kernel read its pages at in one decode step at the same-memory run's batch
# and 1,536 tokens of context (H200, session 33: `off` at batch 40, q4 at 144, TurboQuant at 100)
RATES = {"off": 4.05, "turboquant": 2.49, "q4": 2.68}
FORMATS = tuple(RATES)
# the same-memory run's model: Llama-3-8B attention (8 KV heads, head_dim 128), 8 layers
NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS = 8, 128, 8


def step_cost(fmt: str, rate_tb_s: float | None = None, **options) -> StepCost:
    """The fitted step cost of `fmt` pages, its decode kernel reading at `rate_tb_s` (default `RATES[fmt]`);
    `options`: other `StepCost` fields (roofline, mixed_floor_s)."""
    rate = RATES[fmt] if rate_tb_s is None else rate_tb_s
    return StepCost(per_context_token_s=page_bytes_per_token(fmt) / (rate * 1e12), **options)


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
    pending, cache, steps, largest, fed, seconds, used = list(seqs), scheduler.cache, 0, 0, 0, 0.0, 0
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
        if cost is not None:  # a decode reads its context and the token it writes
            spans = [s.num_computed_tokens + 1 for s, n in zip(batch.seqs, batch.num_new_tokens) if n == 1]
            seconds += cost(len(spans), batch.num_tokens - len(spans), sum(spans))
        scheduler.after_step(batch)
        used += cache.pool.num_used
        largest = max(largest, len(batch.seqs))
        fed += batch.num_tokens
        for seq in batch.seqs:
            if seq.num_computed_tokens == len(seq.token_ids):
                seq.token_ids.append(7)
                if seq.num_output_tokens >= ends[seq.seq_id]:
                    seq.finish("length")
                    scheduler.finish(seq)
    assert cache.pool.num_used == 0 and not cache.seqs
    cache.pool.check()
    out = {"preemptions": scheduler.num_preemptions, "steps": steps, "tokens_fed": fed, "largest_batch": largest,
           "pages_in_use": used / steps / cache.pool.num_blocks}   # mean share of the blocks held after a step
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
    p.add_argument("--rate", action="append", default=[], metavar="FORMAT=TB/S",
                   help=f"the rate a format's decode kernel reads its pages at (default {RATES})")
    p.add_argument("--roofline", action="store_true",
                   help="matrix products bound by the weights' read or by their rows, whichever is longer: prompt "
                        "chunks ride along decode steps (see StepCost)")
    p.add_argument("--mixed-step-ms", type=float, default=0.0, metavar="MS",
                   help="a step holding prompt tokens takes at least MS (an eager step's host time)")
    p.add_argument("--mixed-graph-tokens", type=int, default=0, metavar="S",
                   help="mixed steps replay graphs padded to S rows (cuda_graph_mixed_tokens; pair with "
                        "--max-num-batched-tokens S and --roofline)")
    p.add_argument("--measured", default="bench/results/h200/engine_memory_session42.json.gz",
                   help="same-memory GPU runs to draw beside the model (skipped if missing)")
    p.add_argument("--out", default=None, help="folder for scheduler_sim.json and scheduler_sim.png")
    args = p.parse_args(argv)
    rates = dict(RATES)
    for item in args.rate:
        fmt, _, value = item.partition("=")
        if fmt not in RATES or not value:
            p.error(f"--rate {item!r}: give FORMAT=TB/S with FORMAT one of {', '.join(RATES)}")
        rates[fmt] = float(value)
    args.rates = rates
    requests = [(args.prompt_tokens, args.new_tokens, args.new_tokens)] * args.requests
    results = {"args": vars(args), "runs": {}}
    print("| format | read at (TB/s) | lookahead | steps | preemptions | tokens fed | pages in use | modelled s | "
          "modelled output tokens/s | vs `off` |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for fmt in sorted(args.formats, key=lambda f: f != "off"):  # `off` first: the ratios' base
        num_blocks = blocks_in(fmt, int(args.same_memory * 2**30))
        cost = step_cost(fmt, rates[fmt], roofline=args.roofline, mixed_floor_s=args.mixed_step_ms / 1e3,
                         mixed_rows=args.mixed_graph_tokens)
        results["runs"][fmt] = {}
        for lookahead in args.lookahead:
            start = time.perf_counter()
            scheduler = make_scheduler(num_blocks, max_num_batched_tokens=args.max_num_batched_tokens,
                                       admission_lookahead_tokens=lookahead, max_num_seqs=args.requests)
            r = simulate(scheduler, requests, cost=cost)
            r["tokens_per_s"] = args.requests * args.new_tokens / r["seconds"]
            base = results["runs"].get("off", {}).get(str(lookahead))
            ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}x" if base else ""
            results["runs"][fmt][str(lookahead)] = r
            print(f"| {fmt} | {rates[fmt]:g} | {lookahead} | {r['steps']} | {r['preemptions']} | {r['tokens_fed']} | "
                  f"{r['pages_in_use']:.0%} | {r['seconds']:.2f} | {r['tokens_per_s']:.0f} | {ratio} |  ({time.perf_counter() - start:.1f}s)",
                  flush=True)
    measured = Path(args.measured)
    if measured.exists():
        results["measured"] = {}
        for r in plotting.read_json(measured)["same_memory"].values():
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
