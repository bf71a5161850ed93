"""`SamplingParams`: how one request picks its tokens and when it stops."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..errors import ConfigError


MIN_TEMPERATURE = 1e-5  # temperatures below it sample greedily (as vLLM does)
MAX_N = 128  # samples per request at most
MAX_LOGPROBS = 20  # alternatives per token at most (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, validated on construction (a bad value raises `ConfigError`).

    temperature: 0 picks the most likely token (greedy); > 0 samples from softmax(logits / temperature)
    (below `MIN_TEMPERATURE` it is greedy too: dividing by it would overflow the logits).
    top_p: keep the smallest set of tokens whose probability adds up to at least top_p (1 keeps all).
    top_k: keep the k most likely tokens (0 or -1 keeps all).
    seed: a private random generator for this request, so its samples do not depend on the batch.
    n: samples of the prompt (sharing its blocks); sample i draws with seed + i, so it equals a request of n=1
    seeded with seed + i.
    stop: strings that end the output (not included in the text); stop_token_ids: token ids that do.
    max_tokens: new tokens at most (None: up to the context window).
    ignore_eos: keep going past the end-of-sequence token (benchmarks).
    logprobs: record each new token's log-probability and the `logprobs` most likely alternatives (0: the token
    only); prompt_logprobs: the same for every prompt token after the first (its prompt skips the prefix
    cache). Both come from the model's log-softmax, before temperature and truncation (as vLLM does).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    max_tokens: int | None = 16
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature!r} must be a number >= 0 (0 means greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ConfigError(f"top_k={self.top_k!r} must be a positive integer, or 0 / -1 to keep every token")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ConfigError(f"max_tokens={self.max_tokens!r} must be a positive integer")
        if self.seed is not None and (not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**64):
            raise ConfigError(f"seed={self.seed!r} must be an integer in [-2**63, 2**64) (a 64-bit seed)")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise ConfigError(f"n={self.n!r} must be an integer in [1, {MAX_N}]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise ConfigError(f"{name}={value!r} must be an integer in [0, {MAX_LOGPROBS}] (or None: off)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError(f"stop={self.stop!r} must be non-empty strings")

    def for_sample(self, index: int) -> "SamplingParams":
        """The settings of sample `index` of a request of n samples: one sample, seeded with seed + index."""
        seed = self.seed
        if seed is not None:
            seed = (seed + index) if seed + index < 2**64 else seed + index - 2**64
        return replace(self, n=1, seed=seed)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1
