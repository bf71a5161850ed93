"""`Sequence`: one request's tokens and progress through the engine.

The tokens whose keys/values are in the cache are `token_ids[:num_computed_tokens]`; the rest still
have to go through the model. A waiting sequence holds no blocks; a preempted one goes back to
waiting with `num_computed_tokens = 0` and recomputes its prompt and outputs on readmission.
"""

from __future__ import annotations

import copy
import enum
import time

import torch

from .outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from .sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, seq_id: int, prompt_token_ids: list[int], params: SamplingParams, *,
                 prompt: str | None = None, stream: bool = False, has_max_tokens: bool = True):
        self.request_id = request_id
        self.seq_id = seq_id  # the cache's id for this sequence
        self.prompt = prompt
        self.token_ids = list(prompt_token_ids)
        self.prompt_token_ids = list(prompt_token_ids)  # every output of the request shares this list
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        # the client set max_tokens (else it is the context window's remainder, no guide to the output's length)
        self.has_max_tokens = has_max_tokens
        self.stream = stream  # stream text as it comes (incremental detokenization)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []  # prefix-cache hash of each full block of token_ids
        self.num_registered_blocks = 0  # blocks of the cache sequence registered in the prefix cache
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.text = ""  # detokenized output (see Detokenizer)
        self.detok_state: tuple[int, int] | None = None
        self.generator: torch.Generator | None = None
        self.spec_token_ids: list[int] = []  # drafted tokens to verify after token_ids (speculative decoding)
        self.spec_probs: torch.Tensor | None = None  # [len(spec_token_ids), vocab]: the drafter's distributions
        self.logprobs: list[TokenLogprob] = []  # of each output token (params.logprobs set)
        self.prompt_logprobs: list[TokenLogprob | None] = [None]  # of each prompt token (params.prompt_logprobs set)
        self.penalties = None  # penalties.PenaltyState, on the device, for a request with penalties
        self.sample_index = 0  # which of the request's n samples this is
        self.group: list[Sequence] | None = None  # a request of n > 1: its samples, by index, once it forked
        self.metrics = RequestMetrics(arrival_time=time.perf_counter())

    def spawn(self, index: int, seq_id: int) -> "Sequence":
        """Sample `index` of this request of n samples, before its first token: a copy with its own seed,
        state and cache sequence `seq_id` (which the scheduler forks from this one's blocks)."""
        child = copy.copy(self)
        child.seq_id, child.sample_index, child.params = seq_id, index, self.params.for_sample(index)
        child.token_ids, child.block_hashes = list(self.token_ids), list(self.block_hashes)
        child.logprobs, child.generator, child.spec_token_ids, child.spec_probs = list(self.logprobs), None, [], None
        child.metrics = copy.copy(self.metrics)
        child.penalties = self.penalties.clone() if self.penalties is not None else None
        return child

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.metrics.finished_time = time.perf_counter()

    def output(self, text: str) -> RequestOutput:
        p = self.params
        completion = CompletionOutput(self.sample_index, text, self.output_token_ids, self.finish_reason, self.stop_reason,
                                      list(self.logprobs) if p.logprobs is not None else None)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [completion],
                             self.is_finished, self.metrics, self.error,
                             list(self.prompt_logprobs) if p.prompt_logprobs is not None else None)
