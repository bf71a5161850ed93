"""`EngineConfig`: the engine's settings (the cache's live in `pagedkv.config.CacheConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError

# Every 8 up to 256 (as vLLM captures): a batch pads to the next bucket, and a padded row costs a decode step as much
# as a real one in the matrix products (the same-memory run's q4 batches of 129-146 ran in the 192 bucket at 2.93 ms a
# step against 2.47 ms at 128).
DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4) + tuple(range(8, 257, 8))


@dataclass(frozen=True)
class EngineConfig:
    """Scheduling and model-runner settings, validated on construction.

    max_num_seqs: requests running at once; max_num_batched_tokens: tokens one forward pass may hold
    (decodes first, then prefill chunks fill the rest); prefix_caching: share full blocks between
    requests with a common prefix; enforce_eager: never replay CUDA graphs; cuda_graph_batch_sizes:
    the decode batch sizes captured (a batch runs in the smallest bucket that holds it);
    max_model_len: longest prompt + output (default: the model's max_position_embeddings);
    admission_lookahead_tokens: a request is admitted only if the pool keeps room for the running requests'
    growth until they end (prompt + max_tokens), each looked ahead at most this many tokens (one block for
    a request without max_tokens; 0: admit on free blocks alone); growth past it is met by preemption.
    640 by measurement (H200, the same 2 GiB of pages, 256 requests of 1,024 + 1,024 tokens, lookahead 0-1024,
    `bench/results/h200/engine_memory_sweep.json`, then 512 against 640 in one run, `engine_memory_640.json.gz`: 640
    1.01x / 1.06x / 1.06x faster for `off` / TurboQuant / q4, fewer preemptions for each): a lookahead as long
    as the outputs runs requests that start together in waves that also end together, the last one at a small
    batch (-4% to -11% against 512); none recomputes 3x as many preempted requests (-1% to -7%).
    Prefix-cache tiers (`pagedkv.tiers`): cpu_cache_gb: host memory for blocks evicted from the device pool
    (0: off); kv_cache_dir: a directory keeping them on disk across restarts, up to disk_cache_gb;
    swap_on_preemption: a preempted request's blocks go to the host tier and are loaded back, not recomputed.
    compile_layers: compile each decoder layer with torch.compile (`pagedkv.hf.compile_layers`: the paged cache's
    writes and attention stay outside the graphs; the first steps of each shape compile). None (default): on for a
    model on CUDA that replays CUDA graphs (not enforce_eager) without tensor parallelism, off otherwise. Measured
    on an H200 (8-layer Llama-3-8B shape, `bench/results/h200/engine_*_compiled.json` beside `*_eager_layers.json`):
    decode at batch 64 and 8,192 tokens 1.09-1.20x the output tokens/s, a 2,048-token prefill step 15% faster, the
    same-memory run 1.14-1.24x; the first steps of a process compile (default model: ~17-26 s once). Without CUDA
    graphs a decode step is host-bound and the compiled layers' guards make it slower, hence off with enforce_eager.
    async_scheduling: schedule and queue each step before the host reads the tokens of the one in flight (their
    input rows filled on the device), so the host's part of a step (scheduling, prefix hashes, slot reservation,
    input tensors: ~8-20 ms for a 16,384-token prefill step) overlaps the GPU's work on the step before; a
    sequence that turns out to have finished wasted one token, which is dropped. Decode steps replayed from CUDA
    graphs run one step ahead either way. None (default): on for a model on CUDA (not with tensor parallelism);
    steps with speculative decoding, n > 1 samples, log-probabilities or penalties run in turn. H200, the same-memory
    run: 1.005x (`off`), 1.018x (TurboQuant), 1.009x (q4) the output tokens/s of steps in turn.
    cuda_graph_mixed_tokens: mixed steps of at most this many tokens (decodes, then prefill chunks of at most 2
    sequences) replay CUDA graphs too (`engine.cuda_graph.MixedGraphRunner`): each decode bucket's graph holds its
    decodes and, padded, the chunk tokens a step of this many can add to more decodes than the bucket before holds;
    0 (default): such steps run eagerly, as every step with a prompt chunk does. Set max_num_batched_tokens to the
    same small budget (a few hundred tokens over the decode batch), so that prompts are chunked to ride along decode
    steps, whose matrix products are bound by the weights' reads. Not with tensor parallelism (whose ranks replay the
    decode runner's graphs in step). Off by default: on an H100 the same-memory run (budget 256) was slower than with
    the defaults for every quantized format (q4 27,926 against 33,258 tokens/s; BENCHMARKS.md, session 46).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    prefix_caching: bool = True
    enforce_eager: bool = False
    cuda_graph_batch_sizes: tuple[int, ...] = DEFAULT_GRAPH_BATCH_SIZES
    max_model_len: int | None = None
    admission_lookahead_tokens: int = 640
    cpu_cache_gb: float = 0.0
    kv_cache_dir: str | None = None
    disk_cache_gb: float = 16.0
    swap_on_preemption: bool = False
    compile_layers: bool | None = None
    async_scheduling: bool | None = None
    cuda_graph_mixed_tokens: int = 0

    def __post_init__(self):
        if isinstance(self.cuda_graph_mixed_tokens, bool) or not isinstance(self.cuda_graph_mixed_tokens, int) \
                or self.cuda_graph_mixed_tokens < 0:
            raise ConfigError(f"cuda_graph_mixed_tokens={self.cuda_graph_mixed_tokens!r} must be an integer >= 0 (0: "
                              "mixed steps run eagerly)")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if not isinstance(self.admission_lookahead_tokens, int) or self.admission_lookahead_tokens < 0:
            raise ConfigError(f"admission_lookahead_tokens={self.admission_lookahead_tokens!r} must be an integer >= 0")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ConfigError(f"max_model_len={self.max_model_len!r} must be an integer >= 2")
        for name in ("cpu_cache_gb", "disk_cache_gb"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"{name}={value!r} must be a number of GiB >= 0")
        if self.has_tiers and not self.prefix_caching:
            raise ConfigError("cpu_cache_gb / kv_cache_dir keep prefix-cache blocks: they need prefix_caching=True")
        if self.swap_on_preemption and not self.cpu_cache_gb:
            raise ConfigError("swap_on_preemption swaps blocks to the host tier: give it room with cpu_cache_gb > 0")
        sizes = tuple(sorted({int(b) for b in self.cuda_graph_batch_sizes}))
        if not sizes or sizes[0] < 1:
            raise ConfigError(f"cuda_graph_batch_sizes={self.cuda_graph_batch_sizes!r} must be positive integers")
        object.__setattr__(self, "cuda_graph_batch_sizes", sizes)
        if self.compile_layers not in (None, True, False):
            raise ConfigError(f"compile_layers={self.compile_layers!r} must be True, False or None (on for CUDA graphs)")
        if self.async_scheduling not in (None, True, False):
            raise ConfigError(f"async_scheduling={self.async_scheduling!r} must be True, False or None (on for CUDA)")

    def compiles_layers(self, device: torch.device, tensor_parallel: bool = False) -> bool:
        """Whether a model on `device` gets its decoder layers compiled (compile_layers, None resolved: not with
        tensor parallelism, whose sharded layers' collectives it was not timed or tested with)."""
        if self.compile_layers is not None:
            return self.compile_layers
        return torch.device(device).type == "cuda" and not self.enforce_eager and not tensor_parallel

    def schedules_async(self, device: torch.device, tensor_parallel: bool = False) -> bool:
        """Whether an engine whose model is on `device` queues each step before reading the one in flight (None
        resolved: not with tensor parallelism, whose ranks were not tested with it)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return torch.device(device).type == "cuda" and not tensor_parallel

    @property
    def has_tiers(self) -> bool:
        """Whether prefix-cache blocks also go to a host tier (cpu_cache_gb) or a disk tier (kv_cache_dir)."""
        return bool(self.cpu_cache_gb) or bool(self.kv_cache_dir)

    @property
    def graph_batch_sizes(self) -> tuple[int, ...]:
        """The captured buckets: up to the first one that holds max_num_seqs."""
        sizes = [b for b in self.cuda_graph_batch_sizes if b < self.max_num_seqs]
        bigger = [b for b in self.cuda_graph_batch_sizes if b >= self.max_num_seqs]
        return tuple(sizes + bigger[:1]) if bigger else tuple(sizes)
