"""The engine's host-side (Python) work per decode step, on the CPU, at several batch sizes.

On a GPU, decode steps replay CUDA graphs queued one step ahead, so the host's work per step
(scheduling, slot reservation, block tables, copies, sampling bookkeeping, stop checks, outputs)
overlaps the GPU and only shows when it is the longer of the two. Here the GPU's part is taken out:

- the model's forward is a stand-in returning random logits (the engine is built around a real
  1-layer Llama, so the cache, tokenizer-free requests and options are the real ones);
- decode steps go through the real `CUDAGraphRunner.run` (reservation, host mirrors, copies into the
  static buffers) and `LLMEngine._run_ahead`, with a stand-in graph whose replay does nothing and
  whose logits are a fixed random [bs, --logits-width] tensor (a narrow one, so the sampler's argmax,
  GPU work on a GPU, stays out of the numbers).

The window is bench/engine_gpu.py's: `--batch` requests of `--context` prompt tokens that ignore EOS,
prefilled 16,384 tokens a step (so they start decoding a few steps apart), `--warm` decode steps,
then `--steps` timed ones, with max_tokens such that the first-prefilled requests finish inside the
window (their finishing steps count, as they do on the GPU). The window runs twice on fresh engines:
untimed, for the step times, and with each phase timed by wrapping the engine's methods (inclusive
means per step; nested phases are indented). The prefill before the window is timed too: the host's part of a
prefill step (scheduling, prefix hashes, slot reservation, the input tensors), which the GPU waits for. Writes
bench/results/engine_host.json, keeping the runs of other `--label`s, and prints the `--compare` label's
largest-batch column beside this run's.

    python bench/engine_host.py --label after --compare before
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import plotting  # noqa: E402  (bench/plotting.py, beside this script)

from pagedkv import LLM, SamplingParams  # noqa: E402
from pagedkv.engine.cuda_graph import CUDAGraphRunner  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "engine_host.json"


class _NoReplay:
    def replay(self) -> None:
        pass


class HostOnlyGraphRunner(CUDAGraphRunner):
    """The CUDA-graph decode path without the GPU: capture records nothing, replay does nothing."""

    def __init__(self, *args, logits_width: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.logits_width = logits_width

    def is_capturable(self) -> bool:
        return True

    def _capture(self, bs: int):
        generator = torch.Generator().manual_seed(bs)
        return _NoReplay(), torch.randn(bs, self.logits_width, generator=generator)


class StubModel(torch.nn.Module):
    """The eager path's forward (prefill) without the model: random logits for the kept rows."""

    def __init__(self, config, width: int):
        super().__init__()
        self.config = config
        self.width = width
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # the runner reads the device off a parameter

    def forward(self, input_ids, logits_to_keep, **kwargs):
        return SimpleNamespace(logits=torch.randn(1, len(logits_to_keep), self.width))


def build_llm(batch: int, context: int, max_tokens: int, vocab: int, width: int) -> LLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8192,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config).eval()
    blocks_per_seq = -(-(context + max_tokens + 16) // 16)
    llm = LLM(model, num_blocks=batch * blocks_per_seq + 64, max_num_seqs=batch, max_num_batched_tokens=16384)
    runner = llm.engine.runner
    runner.model = StubModel(config, width)
    runner.graphs = HostOnlyGraphRunner(runner.model, llm.engine.cache, runner.cache_kwarg,
                                        llm.engine.config.graph_batch_sizes,
                                        max_blocks_per_seq=llm.engine.cache.blocks_for(llm.engine.max_model_len),
                                        logits_width=width)
    return llm


def phases(engine) -> list[tuple[str, object, str]]:
    """(label, owner, method) of each timed phase; a label's indent marks it as part of the one above."""
    graphs = engine.runner.graphs
    wanted = [
        ("schedule (scheduler path)", engine.scheduler, "schedule"),
        ("runner.run (scheduler path)", engine.runner, "run"),
        ("_run_ahead", engine, "_run_ahead"),
        ("  graphs.run", graphs, "run"),
        ("    cache.reserve", engine.cache, "reserve"),
        ("    graphs._fill_host", graphs, "_fill_host"),
        ("_sample", engine, "_sample"),
        ("  sampler.sample", engine.sampler, "sample"),
        ("_finish", engine, "_finish"),
        ("  scheduler.after_step", engine.scheduler, "after_step"),
        ("  _retire (finished requests)", engine, "_retire"),
    ]
    return [(label, owner, name) for label, owner, name in wanted if hasattr(owner, name)]


def instrument(engine, totals: dict[str, float]) -> list[tuple[object, str]]:
    """Wrap each phase's method on its instance to add its wall time to totals[label]; returns what to undo."""
    wrapped = []
    for label, owner, name in phases(engine):
        fn = getattr(owner, name)

        def timed(*args, _fn=fn, _label=label, **kwargs):
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                totals[_label] = totals.get(_label, 0.0) + time.perf_counter() - t0

        setattr(owner, name, timed)
        wrapped.append((owner, name))
    return wrapped


def run_window(batch: int, context: int, steps: int, warm: int, vocab: int, width: int, timed: bool) -> dict:
    """Prefill `batch` requests, decode `warm` steps, then time `steps` steps (per phase if `timed`)."""
    max_tokens = warm + steps + 10  # as bench/engine_gpu.py: the first-prefilled requests finish in the window
    llm = build_llm(batch, context, max_tokens, vocab, width)
    engine = llm.engine
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, vocab, (batch, context), generator=g).tolist()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seqs = [engine.requests[engine.add_request(p, params)] for p in prompts]
    t0, prefill_steps = time.perf_counter(), 0
    while any(s.num_output_tokens == 0 for s in seqs):
        engine.step()
        prefill_steps += 1
    prefill_s = time.perf_counter() - t0
    prefill_ms_per_step = prefill_s * 1e3 / prefill_steps
    for _ in range(warm):
        engine.step()
    assert engine._in_flight is not None, "decode steps are not queued ahead: the harness measures the wrong path"
    totals: dict[str, float] = {}
    undo = instrument(engine, totals) if timed else []
    step_us, finished = [], []
    ahead0, done0 = engine.num_steps_ahead, engine.num_finished
    gc_before = sum(s["collections"] for s in gc.get_stats())
    for _ in range(steps):
        n = engine.num_finished
        t = time.perf_counter()
        engine.step()
        step_us.append((time.perf_counter() - t) * 1e6)
        finished.append(engine.num_finished - n)
    gc_runs = sum(s["collections"] for s in gc.get_stats()) - gc_before
    for owner, name in undo:
        delattr(owner, name)
    out = {"step_us": step_us, "finished_per_step": finished, "steps_queued_ahead": engine.num_steps_ahead - ahead0,
           "requests_finished": engine.num_finished - done0, "gc_collections": gc_runs, "prefill_s": prefill_s,
           "prefill_steps": prefill_steps, "prefill_ms_per_step": prefill_ms_per_step,
           "phases_us": {label: totals.get(label, 0.0) / steps * 1e6 for label, _, _ in phases(engine)} if timed else {}}
    while engine.has_unfinished():
        engine.step()
    assert engine.cache.pool.num_used == 0
    del llm, engine, seqs
    gc.collect()
    return out


def measure(batch: int, context: int, steps: int, warm: int, vocab: int, width: int) -> dict:
    """The window run twice: untimed (step times) and with every phase timed (per-phase means)."""
    plain = run_window(batch, context, steps, warm, vocab, width, timed=False)
    timed = run_window(batch, context, steps, warm, vocab, width, timed=True)
    steady = [t for t, n in zip(plain["step_us"], plain["finished_per_step"]) if n == 0]
    return {"step_us_mean": statistics.fmean(plain["step_us"]), "step_us_median": statistics.median(plain["step_us"]),
            "step_us_steady_mean": statistics.fmean(steady) if steady else None,
            "step_us_timed_mean": statistics.fmean(timed["step_us"]),
            **{k: plain[k] for k in ("step_us", "finished_per_step", "steps_queued_ahead", "requests_finished",
                                     "gc_collections", "prefill_s", "prefill_steps", "prefill_ms_per_step")},
            "phases_us": timed["phases_us"]}


def table(columns: dict[str, dict], title: str) -> str:
    labels = []
    for col in columns.values():
        labels += [k for k in col["phases_us"] if k not in labels]
    head = f"| {title} | " + " | ".join(columns) + " |"
    lines = [head, "| --- |" + " --- |" * len(columns)]
    for key, name in (("step_us_mean", "step, mean over the window"), ("step_us_steady_mean", "step, mean where none finished"),
                      ("step_us_timed_mean", "step, mean with phases timed")):
        lines.append(f"| {name} | " + " | ".join(f"{c[key]:.0f}" for c in columns.values()) + " |")
    for label in labels:
        if all(c["phases_us"].get(label, 0.0) < 0.5 for c in columns.values()):
            continue  # a path no timed step took (the scheduler's, when every step is queued ahead)
        cells = [f"{c['phases_us'][label]:.0f}" if label in c["phases_us"] else "-" for c in columns.values()]
        lines.append(f"| {label.replace('  ', '&nbsp;&nbsp;')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(stored: dict, path: Path) -> bool:
    """Host microseconds per decode step at each batch, one bar per stored run, and the top-level phases
    at the largest batch."""
    plt = plotting.pyplot()
    if plt is None:
        return False
    runs = stored["runs"]
    batches = sorted({int(b) for r in runs.values() for b in r["batches"]})
    big = str(max(batches))
    prefill = {label: [r["batches"].get(str(b), {}).get("prefill_ms_per_step", 0) for b in batches]
               for label, r in runs.items()}
    with_prefill = any(v for values in prefill.values() for v in values)
    fig, axes = plt.subplots(1, 3 if with_prefill else 2, figsize=(18 if with_prefill else 12, 4))
    ax0, ax1 = axes[0], axes[1]
    if with_prefill:   # runs stored before the prefill was timed have no bar here
        for container, values in zip(plotting.grouped_bars(axes[2], [f"batch {b}" for b in batches], prefill),
                                     prefill.values()):
            axes[2].bar_label(container, [f"{v:.1f}" for v in values], fontsize=7)
        axes[2].set_ylabel("host ms per prefill step (up to 16,384 tokens), lower is better")
        axes[2].legend(fontsize=8)
    series = {label: [r["batches"].get(str(b), {}).get("step_us_mean", 0) for b in batches] for label, r in runs.items()}
    for container, values in zip(plotting.grouped_bars(ax0, [f"batch {b}" for b in batches], series), series.values()):
        ax0.bar_label(container, [f"{v:.0f}" for v in values], fontsize=7)
    ax0.set_ylabel("host us per decode step (mean), lower is better")
    ax0.legend(fontsize=8)
    phases_at_big = {label: r["batches"].get(big, {}).get("phases_us", {}) for label, r in runs.items()}
    top_level = [p for p in next(iter(phases_at_big.values())) if not p.startswith(" ")]
    top_level = [p for p in top_level if any(ph.get(p, 0) for ph in phases_at_big.values())]
    plotting.grouped_bars(ax1, top_level, {label: [ph.get(p, 0) for p in top_level] for label, ph in phases_at_big.items()},
                          horizontal=True)
    ax1.tick_params(axis="y", labelsize=8)
    ax1.set_xlabel(f"host us per step at batch {big}, by phase")
    fig.suptitle("engine host work per decode step and per prefill step (CPU, stand-in model and graph replay)",
                 fontsize=9)
    plotting.save(fig, path)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--warm", type=int, default=3)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--logits-width", type=int, default=256, help="columns of the stand-in logits (tokens < this)")
    p.add_argument("--label", default="current", help="the name this run is stored under in the JSON")
    p.add_argument("--compare", default=None, help="a label stored earlier, shown beside this run at the largest batch")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--replot", action="store_true", help="only redraw the PNG next to --out from the runs stored there")
    args = p.parse_args(argv)
    if args.replot:
        return 0 if plot(json.loads(Path(args.out).read_text()), Path(args.out).with_suffix(".png")) else 1
    torch.set_num_threads(1)

    run = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "args": vars(args),
           "command": "python bench/engine_host.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "batches": {}}
    for b in args.batches:
        run["batches"][str(b)] = measure(b, args.context, args.steps, args.warm, args.vocab, args.logits_width)
        r = run["batches"][str(b)]
        print(f"batch {b}: {r['step_us_mean']:.0f} us per step ({r['requests_finished']} requests finished in the "
              f"window, {r['steps_queued_ahead']} of {args.steps} steps queued ahead); prefill "
              f"{r['prefill_ms_per_step']:.1f} ms per step of up to 16,384 tokens "
              f"({r['prefill_steps']} steps)", flush=True)

    out = Path(args.out)
    stored = json.loads(out.read_text()) if out.exists() else {"runs": {}}
    stored["runs"][args.label] = run
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(stored, indent=2))
    plot(stored, out.with_suffix(".png"))

    print(f"\nhost us per decode step, {args.context} tokens of context ({args.label})")
    print(table({f"batch {b}": c for b, c in run["batches"].items()}, "phase"))
    big = str(max(args.batches))
    if args.compare and big in stored["runs"].get(args.compare, {}).get("batches", {}):
        cols = {args.compare: stored["runs"][args.compare]["batches"][big], args.label: run["batches"][big]}
        print(f"\nbatch {big}, host us per decode step")
        print(table(cols, "phase"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
