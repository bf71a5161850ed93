"""`pagedkv eval`: what each page format costs in quality, measured against dense pages ("off").

For every format, on one model and one text:
  - perplexity in windows: the first half of each window is prefilled through the cache, the second half
    is scored through the same cache; mean KL divergence and top-1 agreement of the next-token
    distributions against "off" on the same tokens;
  - a context-degradation profile: perplexity by position bucket over one long stretch of the text, up to
    the model's context length, prefilled through the cache in chunks;
  - passkey retrieval: a number hidden at several depths in filler text, asked for at the end, at several
    lengths; a trial passes when greedy decoding would produce the number;
  - bytes per token per KV head (the model's head_dim and 128), averaged over layers.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .config import FORMAT_HELP, KVFormat
from .errors import ConfigError
from .passkey import PasskeyTrial, passkey_trial

DEFAULT_FORMATS = "off,q8,turboquant"
PASSKEY_LENGTHS = (1024, 2048, 4096, 8192)
PASSKEY_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
PREFILL_CHUNK = 1024
_FORMAT_OPTIONS = ("k=", "v=", "k_quant=", "v_quant=", "rotate_keys", "boundary_layers=", "recent_tokens=")


@dataclass(frozen=True)
class EvalFormat:
    """One row of the evaluation: a page format and how many boundary layers stay dense."""

    kv_format: KVFormat
    boundary_layers: int = 0

    @property
    def label(self) -> str:
        base = str(self.kv_format)
        if self.boundary_layers and not self.kv_format.is_dense:
            base += ("," if ":" in base else ":") + f"boundary_layers={self.boundary_layers}"
        return base

    def cache_options(self) -> dict:
        return {"kv_format": self.kv_format, "boundary_layers": self.boundary_layers}


def parse_formats(items: list[str] | str, boundary_layers: int = 0) -> list[EvalFormat]:
    """`off,q8,turboquant:k=q4_0,v=q4_0,rotate_keys,boundary_layers=2` -> one EvalFormat per format.

    Items are split on commas; option items (k=, v=, rotate_keys, boundary_layers=N) belong to the format
    before them. `boundary_layers` applies to formats that give none. "off" always comes first.
    """
    if isinstance(items, str):
        items = [items]
    entries: list[list[str]] = []
    for item in (p.strip() for text in items for p in text.split(",")):
        if not item:
            continue
        if item.lower().startswith(_FORMAT_OPTIONS) and ":" not in item:
            if not entries:
                raise ConfigError(f"--formats: option {item!r} comes before any format; {FORMAT_HELP}")
            entries[-1].append(item)
        else:
            entries.append([item])
    out: list[EvalFormat] = []
    for parts in entries:
        head, options = parts[0], parts[1:]
        name, _, first = head.partition(":")
        if first:
            options.insert(0, first)
        boundary = boundary_layers
        rest = []
        for opt in options:
            key, _, value = opt.partition("=")
            if key.strip().lower() == "boundary_layers":
                try:
                    boundary = int(value)
                except ValueError:
                    raise ConfigError(f"--formats: boundary_layers={value!r} is not an integer") from None
            else:
                rest.append(opt)
        spec = KVFormat.parse(name + (":" + ",".join(rest) if rest else ""))
        if boundary < 0:
            raise ConfigError(f"--formats: boundary_layers={boundary} must be >= 0")
        entry = EvalFormat(spec, 0 if spec.is_dense else boundary)
        if entry not in out:
            out.append(entry)
    off = EvalFormat(KVFormat())
    return [off] + [f for f in out if f != off]


# ------------------------------------------------------------------------------------------------
# running a model through a fresh cache
@dataclass
class Runner:
    """The model, switched to pagedkv, and one cache per format reused across measurements."""

    model: torch.nn.Module
    cache_kwarg: str
    caches: dict = field(default_factory=dict)

    def cache(self, fmt: EvalFormat):
        from .hf import install_paged_kv_cache

        cache = self.caches.get(fmt)
        if cache is None:
            cache = self.caches[fmt] = install_paged_kv_cache(self.model, dynamic=True, **fmt.cache_options())
        cache.reset()
        return cache

    @torch.inference_mode()
    def forward(self, cache, ids: torch.Tensor, logits_to_keep: int = 0, step: int = PREFILL_CHUNK) -> torch.Tensor:
        """Feed ids [1, n] through `cache` in chunks of `step` tokens; log-probs [keep, vocab] (float32, or
        float64 for a float64 model) of the last positions."""
        n = ids.shape[1]
        keep = n if logits_to_keep == 0 else logits_to_keep
        outs = []
        for start in range(0, n, step):
            chunk = ids[:, start:start + step]
            want = max(0, keep - (n - start - chunk.shape[1]))  # positions of this chunk that are kept
            out = self.model(input_ids=chunk, logits_to_keep=max(want, 1), **{self.cache_kwarg: cache})
            if want:
                logits = out.logits[0, -want:]
                outs.append(logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1))
        return torch.cat(outs)


def window_logprobs(runner: Runner, fmt: EvalFormat, window: torch.Tensor) -> torch.Tensor:
    """window [W] token ids -> log-probs [W - W//2, vocab] predicting tokens W//2 .. W-1.

    The first half is prefilled through the cache; the second half is scored through the same cache in one
    forward, or, for a format with a recent dense window, in steps of one block (`score_step`), so that every
    token sees the window it would see in generation (one forward would give all its queries the window of
    its last token). Without a window both read the same pages; block steps cost 12x the time on 2 CPU
    cores (182 s against 16 s a window).
    """
    half = window.shape[0] // 2
    cache = runner.cache(fmt)
    first = runner.forward(cache, window[None, :half], logits_to_keep=1)  # predicts token `half`
    step = score_step(cache) if fmt.kv_format.recent_tokens else PREFILL_CHUNK
    rest = runner.forward(cache, window[None, half:-1], step=step)      # predict half+1 .. W-1
    return torch.cat([first, rest])


def position_buckets(length: int) -> list[tuple[int, int]]:
    """[0, 256), [256, 512), [512, 1K), ... doubling, the last ending at `length`."""
    edges = [0, min(256, length)]
    while edges[-1] < length:
        edges.append(min(edges[-1] * 2, length))
    return list(zip(edges[:-1], edges[1:]))


def score_step(cache) -> int:
    """Tokens per scoring forward: one block, so each step writes its tokens and then attends to them and to
    the pages before, as decoding does (a recent dense window is measured as it behaves in generation)."""
    return cache.block_size


PROFILE_CHUNK = 256  # tokens the context profile moves all formats forward at a time (a multiple of any block)


def kl_against(reference: torch.Tensor):
    """lp -> KL(reference || lp) per row of log-probs [n, vocab], summed in float64 (float32 sums over the
    vocabulary carry ~1e-7 of rounding, as much as the KL of a near-lossless format, and differ with the number
    of rows); the reference's float64 log-probs and probabilities are made once, for every format."""
    ref = reference.double()
    probs = ref.exp()
    return lambda lp: (probs * (ref - lp.double())).sum(-1)


def profile_scores(runner: Runner, fmts: list[EvalFormat], ids: torch.Tensor) -> dict:
    """ids [L] -> {fmt: (nll [L - 1], kl [L - 1])} for tokens 1..L-1, float64, KL(fmts[0] || fmt) per token.

    Every format reads the stretch through its own cache from the first token, in lockstep chunks of
    `PROFILE_CHUNK` tokens, so only one chunk of fmts[0]'s log-probs is held for the KL. Inside a chunk, a
    format with a dense recent window takes steps of one block (`score_step`), each token reading the window
    it would read in generation; one without takes the chunk in one forward, which writes every token before
    any is attended, the same pages and reads as block steps (equal up to float rounding, tested), at a
    fraction of the forwards.
    """
    caches = {f: runner.cache(f) for f in fmts}
    steps = {f: score_step(c) if f.kv_format.recent_tokens else PROFILE_CHUNK for f, c in caches.items()}
    if any(PROFILE_CHUNK % step for step in steps.values()):
        raise ConfigError(f"the context profile steps formats in chunks of {PROFILE_CHUNK} tokens; give every format a "
                          f"block_size that divides it, not {sorted(set(steps.values()))}")
    targets = ids[1:]
    out = {f: ([], []) for f in fmts}
    start = 0
    while start < targets.shape[0]:
        kl = None
        chunk = ids[None, start:min(start + PROFILE_CHUNK, targets.shape[0])]
        for f in fmts:
            lp = runner.forward(caches[f], chunk, step=steps[f])  # [n, vocab]
            if kl is None:
                kl = kl_against(lp)
            n = lp.shape[0]
            out[f][0].append(-lp.gather(-1, targets[start:start + n, None]).squeeze(-1).double())
            out[f][1].append(kl(lp))
        start += n
    return {f: (torch.cat(nll), torch.cat(kl)) for f, (nll, kl) in out.items()}


# ------------------------------------------------------------------------------------------------
# passkey retrieval
def passkey_passes(runner: Runner, fmt: EvalFormat, trial: PasskeyTrial) -> bool:
    """Whether greedy decoding after the prompt yields the pass key (checked in one teacher-forced pass)."""
    device = runner.model.device
    ids = torch.cat([trial.prompt_ids, trial.answer_ids[:-1]]).to(device)
    lp = runner.forward(runner.cache(fmt), ids[None], logits_to_keep=trial.answer_ids.shape[0])
    return bool(torch.equal(lp.argmax(-1), trial.answer_ids.to(device)))


# ------------------------------------------------------------------------------------------------
# bytes
def bytes_per_token_per_head(fmt: EvalFormat, num_layers: int, head_dim: int, dtype: torch.dtype) -> float:
    """Mean bytes one token takes per layer and KV head (boundary layers are dense in `dtype`)."""
    from .config import CacheConfig
    from .formats import make_format

    config = CacheConfig(kv_format=fmt.kv_format, boundary_layers=fmt.boundary_layers, num_layers=num_layers)
    sizes = {}
    total = 0
    for layer in range(num_layers):
        spec = config.layer_format(layer)
        if spec not in sizes:
            sizes[spec] = make_format(spec, 1, head_dim, dtype, "cpu").bytes_per_token_per_head()
        total += sizes[spec]
    return total / num_layers


# ------------------------------------------------------------------------------------------------
# the whole evaluation
@dataclass
class EvalSettings:
    model: str = "default"
    text: str = ""
    formats: list[EvalFormat] = field(default_factory=lambda: parse_formats(DEFAULT_FORMATS))
    window: int = 2048
    max_tokens: int = 8192
    profile_tokens: int | None = None  # default: the model's context length
    passkey_lengths: tuple[int, ...] = PASSKEY_LENGTHS
    passkey_depths: tuple[float, ...] = PASSKEY_DEPTHS
    device: str | None = None
    dtype: str | None = None
    progress: bool = True

    def validate(self) -> None:
        if self.window < 4 or self.window % 2:
            raise ConfigError(f"--window {self.window}: must be an even number of tokens >= 4")
        if self.max_tokens < self.window:
            raise ConfigError(f"--max-tokens {self.max_tokens} is smaller than --window {self.window}; "
                              "it must hold at least one window")
        if any(length < 64 for length in self.passkey_lengths):
            raise ConfigError("--passkey-lengths: each length must be at least 64 tokens")
        if any(not 0 <= d <= 1 for d in self.passkey_depths):
            raise ConfigError("--passkey-depths: each depth must be between 0 and 1")
        if self.profile_tokens is not None and (self.profile_tokens < 0 or self.profile_tokens == 1):
            raise ConfigError(f"--profile-tokens {self.profile_tokens}: must be >= 2 (0 skips the profile)")


def _read_tokens(tokenizer, path: str, num_tokens: int) -> torch.Tensor:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--text {path!r}: cannot read it ({exc.strerror}); give a UTF-8 text file") from None
    # tokenize only what is needed (a token is rarely more than 12 characters of prose)
    ids = tokenizer(text[: num_tokens * 12 + 1000], return_tensors="pt").input_ids[0]
    return ids[:num_tokens]


def measure_windows(runner: Runner, fmts: list[EvalFormat], ids: torch.Tensor, window: int, bar) -> dict:
    """Perplexity, KL and top-1 agreement against fmts[0] ("off") over consecutive windows of `ids`, and the
    standard error of the perplexity increase: the per-token log-likelihood differences against "off" are
    paired, so their spread says how far two equally good quantizations of the same pages could land apart
    (ppl ratio = exp(mean difference); the error is that of the mean, carried through the exp)."""
    num_windows = ids.shape[0] // window
    acc = {f: {"nll": [], "kl": 0.0, "top1": 0} for f in fmts}
    for w in range(num_windows):
        tokens = ids[w * window:(w + 1) * window]
        targets = tokens[window // 2:]
        reference = None
        for f in fmts:
            bar.set_description(f"perplexity window {w + 1}/{num_windows} {f.label}")
            lp = window_logprobs(runner, f, tokens)  # [scored, vocab]
            if reference is None:
                reference, kl = lp, kl_against(lp)
            acc[f]["nll"].append(-lp.gather(-1, targets[:, None]).squeeze(-1).double())
            acc[f]["kl"] += float(kl(lp).sum())
            acc[f]["top1"] += int((reference.argmax(-1) == lp.argmax(-1)).sum())
            bar.update(window)
    scored = num_windows * (window - window // 2)
    base = torch.cat(acc[fmts[0]]["nll"])
    out = {}
    for f, a in acc.items():
        nll = torch.cat(a["nll"])
        out[f] = {"ppl": math.exp(float(nll.mean())), "kl": a["kl"] / scored, "top1": a["top1"] / scored,
                  "ppl_increase_se_pct": paired_increase(nll, base)[1]}
    return out


def paired_increase(nll: torch.Tensor, base: torch.Tensor) -> tuple[float, float]:
    """Per-token NLL [n] of a format and of "off" on the same tokens -> (perplexity increase %, its standard
    error %): ppl ratio = exp(mean difference), the error that of the mean, carried through the exp."""
    diff = nll - base
    ratio = math.exp(float(diff.mean()))
    se = float(diff.std()) / math.sqrt(len(diff)) if len(diff) > 1 else 0.0
    return 100.0 * (ratio - 1.0), 100.0 * ratio * se


def measure_profile(runner: Runner, fmts: list[EvalFormat], ids: torch.Tensor) -> dict:
    """Per position bucket of `ids` [L] and format: perplexity, its increase against fmts[0] ("off") with the
    paired standard error, and the mean KL(off || format) per token."""
    buckets = position_buckets(ids.shape[0])
    scores = profile_scores(runner, fmts, ids)  # nll[j] scores token j + 1
    base = scores[fmts[0]][0]
    out = {}
    for f, (nll, kl) in scores.items():
        spans = [slice(max(a - 1, 0), b - 1) for a, b in buckets]
        spans = [s if s.stop > s.start else None for s in spans]
        nan = float("nan")
        inc = [paired_increase(nll[s], base[s]) if s else (nan, nan) for s in spans]
        out[f] = {"buckets": [[a, b] for a, b in buckets],
                  "ppl": [math.exp(float(nll[s].mean())) if s else nan for s in spans],
                  "ppl_increase_pct": [i for i, _ in inc], "ppl_increase_se_pct": [e for _, e in inc],
                  "kl": [float(kl[s].mean()) if s else nan for s in spans]}
    return out


def measure_passkey(runner: Runner, fmt: EvalFormat, trials: list[PasskeyTrial], bar) -> tuple[dict, dict]:
    """(passkey accuracy per prompt length, each trial's result per length and depth: which keys a format
    misses beside the ones `off` misses)."""
    passed: dict[int, list[bool]] = {}
    by_depth: dict[str, dict[str, int]] = {}
    for t in trials:
        bar.set_description(f"passkey {t.length} depth {t.depth:.0%} {fmt.label}")
        ok = passkey_passes(runner, fmt, t)
        passed.setdefault(t.length, []).append(ok)
        by_depth.setdefault(str(t.length), {})[f"{t.depth:g}"] = int(ok)
        bar.update(t.prompt_ids.shape[0])
    return {str(n): sum(p) / len(p) for n, p in passed.items()}, by_depth


def run_eval(settings: EvalSettings, checkpoint: Callable[[dict], None] | None = None) -> dict:
    """Measure every format; returns the report (also what `--json` writes).

    `checkpoint(report)`, when given, receives the report so far after each completed measurement
    (long runs keep what they measured); `report["complete"]` is False until the end.
    """
    from tqdm.auto import tqdm

    from .options import resolve_device_dtype
    from .hf import cache_kwarg, switch_model, text_config
    from .models import load_model

    settings.validate()
    device, dtype = resolve_device_dtype(argparse.Namespace(device=settings.device, dtype=settings.dtype))
    model, tokenizer = load_model(settings.model, dtype=dtype, device=device)
    switch_model(model)
    runner = Runner(model, cache_kwarg(model))
    cfg = text_config(model.config)
    num_layers = cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    context = getattr(cfg, "max_position_embeddings", None) or settings.max_tokens
    profile_len = context if settings.profile_tokens is None else min(settings.profile_tokens, context)

    window = settings.window
    ids = _read_tokens(tokenizer, settings.text, max(settings.max_tokens // window * window, profile_len))
    num_windows = min(settings.max_tokens, ids.shape[0]) // window
    if num_windows == 0:
        raise ConfigError(f"--text {settings.text!r} has {ids.shape[0]} tokens, fewer than one --window of {window}")
    ids = ids.to(device)
    profile_len = min(profile_len, ids.shape[0])
    trials = [passkey_trial(tokenizer, n, d, seed=1000 * n + round(100 * d))
              for n in settings.passkey_lengths if n <= context for d in settings.passkey_depths]
    fmts = settings.formats
    work = len(fmts) * (num_windows * window + profile_len + sum(t.prompt_ids.shape[0] for t in trials))
    bar = tqdm(total=work, unit="tok", unit_scale=True, desc="eval", disable=not settings.progress,
               file=sys.stderr, dynamic_ncols=True)

    results = {}
    report = {
        "model": settings.model,
        "text": settings.text,
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "window": window,
        "num_windows": num_windows,
        "scored_tokens": num_windows * (window - window // 2),
        "head_dim": head_dim,
        "num_layers": num_layers,
        "profile_tokens": profile_len if profile_len >= 2 else 0,
        "passkey_depths": list(settings.passkey_depths),
        "formats": results,
        "complete": False,
    }
    save = checkpoint or (lambda report: None)
    scores = measure_windows(runner, fmts, ids[:num_windows * window], window, bar)
    for f in fmts:
        results[f.label] = {
            **scores[f],
            "ppl_increase_pct": 100.0 * (scores[f]["ppl"] / scores[fmts[0]]["ppl"] - 1.0),
            "boundary_layers": f.boundary_layers,
            "bytes_per_token_per_head": bytes_per_token_per_head(f, num_layers, head_dim, dtype),
            "bytes_per_token_per_head_d128": bytes_per_token_per_head(f, num_layers, 128, dtype),
        }
    save(report)
    if profile_len >= 2:
        bar.set_description("context profile")
        profiles = measure_profile(runner, fmts, ids[:profile_len])
        for f in fmts:
            results[f.label]["profile"] = profiles[f]
        bar.update(len(fmts) * profile_len)
        save(report)
    if trials:
        for f in fmts:
            results[f.label]["passkey"], results[f.label]["passkey_by_depth"] = measure_passkey(runner, f, trials, bar)
            save(report)
    bar.close()
    report["complete"] = True
    return report


# ------------------------------------------------------------------------------------------------
# the command
def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None


def _ints(text: str) -> tuple[int, ...]:
    """'1k,2048' -> (1024, 2048)."""
    out = []
    for item in (x.strip().lower() for x in text.split(",")):
        if not item:
            continue
        try:
            out.append(int(item[:-1]) * 1024 if item.endswith("k") else int(item))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token counts") from None
    return tuple(out)


def _command_line(args: argparse.Namespace, settings: EvalSettings) -> str:
    """The command that reproduces this run (recorded in the JSON)."""
    parts = ["pagedkv", "eval", "--model", settings.model, "--text", settings.text,
             "--formats", ",".join(f.label for f in settings.formats), "--window", str(settings.window),
             "--max-tokens", str(settings.max_tokens)]
    if settings.profile_tokens is not None:
        parts += ["--profile-tokens", str(settings.profile_tokens)]
    parts += ["--passkey-lengths", ",".join(map(str, settings.passkey_lengths)),
              "--passkey-depths", ",".join(f"{d:g}" for d in settings.passkey_depths)]
    for flag in ("device", "dtype", "json", "plot"):
        if getattr(args, flag):
            parts += [f"--{flag}", getattr(args, flag)]
    return " ".join(shlex.quote(p) for p in parts)


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("eval", help="measure what each page format costs in quality (perplexity, KL, "
                              "top-1 agreement, context profile, passkey retrieval, bytes per token)")
    p.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M-Instruct), a transformers folder, or a .gguf file")
    p.add_argument("--text", required=True, help="UTF-8 text file to measure perplexity on")
    p.add_argument("--formats", nargs="+", default=[DEFAULT_FORMATS], metavar="FORMAT",
                   help="formats, comma-separated: off,q8,turboquant,'turboquant:k=q4_0,v=q4_0,rotate_keys'; "
                        "add boundary_layers=N after a format to keep its first and last N layers dense")
    p.add_argument("--boundary-layers", type=int, default=0, help="boundary layers for formats that give none")
    p.add_argument("--window", type=int, default=2048, help="tokens per perplexity window (half prefilled, "
                   "half scored; default 2048)")
    p.add_argument("--max-tokens", type=int, default=8192, help="text tokens used for the windows (default 8192)")
    p.add_argument("--profile-tokens", type=int, default=None,
                   help="length of the context-degradation profile (default: the model's context length; 0 skips)")
    p.add_argument("--passkey-lengths", type=_ints, default=PASSKEY_LENGTHS,
                   help="passkey prompt lengths (default 1k,2k,4k,8k; empty skips)")
    p.add_argument("--passkey-depths", type=_floats, default=PASSKEY_DEPTHS,
                   help="where the pass key sits, 0..1 (default 0.1,0.3,0.5,0.7,0.9)")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="model dtype (default fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--json", default=None, metavar="OUT.json", help="write the report as JSON")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="write a plot (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    from .quality_report import format_profile_table, format_table, write_plot

    settings = EvalSettings(model=args.model, text=args.text,
                            formats=parse_formats(args.formats, args.boundary_layers), window=args.window,
                            max_tokens=args.max_tokens, profile_tokens=args.profile_tokens,
                            passkey_lengths=tuple(args.passkey_lengths), passkey_depths=tuple(args.passkey_depths),
                            device=args.device, dtype=args.dtype, progress=not args.no_progress)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError("--plot needs matplotlib: pip install 'pagedkv[plot]' (or drop --plot)") from None
    start = time.perf_counter()
    command = _command_line(args, settings)

    def write_json(report: dict) -> None:
        if args.json:
            report.update(seconds=round(time.perf_counter() - start, 1), command=command)
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")

    report = run_eval(settings, checkpoint=write_json)
    write_json(report)
    print(format_table(report))
    profile = format_profile_table(report)
    if profile:
        print(f"\ncontext profile: perplexity increase vs off (± s.e.) and KL per position bucket\n{profile}")
    if args.json:
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        write_plot(report, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
