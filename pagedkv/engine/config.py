"""`EngineConfig`: the engine's settings (the cache's live in `pagedkv.config.CacheConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass(frozen=True)
class EngineConfig:
    """Scheduling and model-runner settings, validated on construction.

    max_num_seqs: requests running at once; max_num_batched_tokens: tokens one forward pass may hold
    (decodes first, then prefill chunks fill the rest); prefix_caching: share full blocks between
    requests with a common prefix; enforce_eager: never replay CUDA graphs; cuda_graph_batch_sizes:
    the decode batch sizes captured (a batch runs in the smallest bucket that holds it);
    max_model_len: longest prompt + output (default: the model's max_position_embeddings).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    prefix_caching: bool = True
    enforce_eager: bool = False
    cuda_graph_batch_sizes: tuple[int, ...] = DEFAULT_GRAPH_BATCH_SIZES
    max_model_len: int | None = None

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ConfigError(f"max_model_len={self.max_model_len!r} must be an integer >= 2")
        sizes = tuple(sorted({int(b) for b in self.cuda_graph_batch_sizes}))
        if not sizes or sizes[0] < 1:
            raise ConfigError(f"cuda_graph_batch_sizes={self.cuda_graph_batch_sizes!r} must be positive integers")
        object.__setattr__(self, "cuda_graph_batch_sizes", sizes)

    @property
    def graph_batch_sizes(self) -> tuple[int, ...]:
        """The captured buckets: up to the first one that holds max_num_seqs."""
        sizes = [b for b in self.cuda_graph_batch_sizes if b < self.max_num_seqs]
        bigger = [b for b in self.cuda_graph_batch_sizes if b >= self.max_num_seqs]
        return tuple(sizes + bigger[:1]) if bigger else tuple(sizes)
