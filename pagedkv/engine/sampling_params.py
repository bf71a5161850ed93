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
    presence_penalty / frequency_penalty: subtracted from a token's logit once if it occurs in the output /
    per occurrence (OpenAI, in [-2, 2]); repetition_penalty: a token seen in the prompt or the output has its
    logit divided by it when positive, multiplied when negative (> 0, 1 = off); min_tokens: the
    end-of-sequence and stop_token_ids are masked until this many tokens came out (stop strings still stop); logit_bias: {token id:
    bias added to its logit} (in [-100, 100]). All applied on the device, before temperature and top-k/p.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
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
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        try:
            object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        except (TypeError, ValueError):
            raise ConfigError(f"logit_bias={self.logit_bias!r} must map token ids to numbers") from None
        if any(t < 0 or not -100 <= b <= 100 for t, b in self.logit_bias):
            raise ConfigError(f"logit_bias={dict(self.logit_bias)!r}: token ids >= 0, biases in [-100, 100]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2 <= value <= 2:
                raise ConfigError(f"{name}={value!r} must be a number in [-2, 2] (0: off)")
        if not isinstance(self.repetition_penalty, (int, float)) or not 0 < self.repetition_penalty <= 10:
            raise ConfigError(f"repetition_penalty={self.repetition_penalty!r} must be in (0, 10] (1: off)")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0 or (
                self.max_tokens is not None and isinstance(self.max_tokens, int) and self.min_tokens > self.max_tokens):
            raise ConfigError(f"min_tokens={self.min_tokens!r} must be an integer in [0, max_tokens]")
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
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.min_tokens or self.logit_bias)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1
