"""What a request returns: `RequestOutput` (one per request) holding its `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """One token's log-probability under the model (log-softmax of its logits, before sampling settings)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability) of the most likely tokens, most likely first


@dataclass
class CompletionOutput:
    """The generated part of a request so far.

    text: decoded new tokens (while streaming, the tail that could still turn out to start a stop string
    is held back); token_ids: every new token, the end-of-sequence token included;
    finish_reason: None while running, else "stop" (EOS, stop string, stop token), "length"
    (max_tokens or the context window), "abort" or "error".
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    logprobs: list[TokenLogprob] | None = None  # one per token id, when SamplingParams.logprobs is set


@dataclass
class RequestMetrics:
    """Wall-clock times (time.perf_counter seconds) of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    num_spec_steps: int = 0  # speculative decoding: steps that verified drafted tokens
    num_draft_tokens: int = 0  # tokens drafted and verified
    num_accepted_tokens: int = 0  # of those, accepted

    @property
    def accepted_tokens_per_step(self) -> float:
        """Drafted tokens accepted per verify step (each step also emits one token of the target's own)."""
        return self.num_accepted_tokens / self.num_spec_steps if self.num_spec_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]  # one list shared by every output of the request
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    error: str | None = None  # set with finish_reason "error"
    # SamplingParams.prompt_logprobs: one per prompt token, None for the first (nothing predicts it)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids
