"""`LLMEngine`: requests in, one scheduled forward pass per `step()`, outputs out.

    step: scheduler.schedule() -> model_runner.run() -> sampler -> stop checks -> free finished blocks

Only the thread that calls `step()` touches the engine's state; `make_sequence` (validation and
tokenization) may run anywhere.
"""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass

import torch

from ..cache import PagedKVCache
from ..errors import CacheCapacityError, ConfigError, ContextWindowError
from ..hf import install_paged_kv_cache, text_config
from .config import EngineConfig
from .detokenizer import Detokenizer
from .model_runner import PLACEHOLDER, ModelRunner
from .outputs import RequestOutput
from .prefix_tiers import make_prefix_cache
from .sampler import Sampler, token_logprobs
from .sampling_params import SamplingParams
from .scheduler import ScheduledBatch, Scheduler
from .spec.speculator import make_speculator
from .sequence import Sequence


@dataclass
class _Step:
    """A forward pass whose sampled tokens may still be on their way to the host."""

    batch: ScheduledBatch
    sampled: list[Sequence]  # the sequences that get a token, in the order of `tokens`
    tokens: torch.Tensor | None  # [len(sampled)] int64, on the model's device
    host: torch.Tensor | None  # pinned host copy being filled (CUDA), else None
    event: "torch.cuda.Event | None"  # recorded after the copy
    is_graph: bool  # replayed from a CUDA graph: the next decode step may be queued behind it
    accepted: list[list[int]] | None = None  # a verify step: the tokens each sampled sequence emits
    logprobs: list | None = None  # TokenLogprob of each sampled token, None for sequences that do not ask
    # set once the next step was scheduled behind this one (`_queue_after`): the scheduler has advanced its
    # sequences, and sampled[i] holds PLACEHOLDER at token_ids[placeholders[i]] (-1: none) until `_finish`
    placeholders: list[int] | None = None


def _eos_token_ids(model, tokenizer) -> set[int]:
    ids = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return ids


class LLMEngine:
    def __init__(self, model: torch.nn.Module, tokenizer, config: EngineConfig, cache_options: dict | None = None,
                 cache: PagedKVCache | None = None, speculative=None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        text = text_config(model.config)
        window = getattr(text, "max_position_embeddings", None)
        self.max_model_len = config.max_model_len or window or 8192
        self.vocab_size = text.vocab_size
        # a ready cache (a tensor-parallel rank's sharded one) or a fresh one built from cache_options
        self.cache: PagedKVCache = cache if cache is not None else install_paged_kv_cache(model, **(cache_options or {}))
        self.prefix = make_prefix_cache(self.cache, config, model, own_cache=cache is None)
        self.scheduler = Scheduler(config, self.cache, self.prefix)
        self.runner = ModelRunner(model, self.cache, config, self.max_model_len)
        self.sampler = Sampler(_eos_token_ids(model, tokenizer))
        self.speculator = make_speculator(speculative, model, self.vocab_size, self.max_model_len, self.runner)
        self.detokenizer = Detokenizer(tokenizer)
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        self.requests: dict[str, Sequence] = {}
        self._seq_ids = itertools.count()
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.num_finished = 0
        self.num_steps = 0
        self.num_steps_ahead = 0  # steps queued behind one in flight
        self._in_flight: _Step | None = None  # a decode step queued on the GPU, tokens not read yet
        self._token_buffers: list[torch.Tensor] | None = None  # pinned, for the sampled tokens of two steps
        self._token_events: list[torch.cuda.Event] = []  # recorded after each buffer's copy
        self._keep_buffers: list[torch.Tensor] = []  # pinned, the rows of a step's tokens the next step keeps
        self.async_scheduling = config.schedules_async(self.runner.device, tensor_parallel=hasattr(self.cache, "peers"))
        self._carried: list[RequestOutput] = []  # outputs of requests failed by a queued step, for the next return

    # ------------------------------------------------------------------------------------------
    # requests
    def capacity_tokens(self) -> int | None:
        """The most tokens one sequence can hold in the pool (None: unbounded growth)."""
        cfg = self.cache.config
        if cfg.dynamic:
            return cfg.context_window_tokens
        return (self.cache.pool.num_blocks or cfg.num_blocks) * cfg.block_size

    def make_sequence(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                      request_id: str | None = None, stream: bool = False) -> Sequence:
        """A validated request (not yet added). Raises ConfigError / ContextWindowError on bad input."""
        params = params or SamplingParams()
        if params.logprobs is not None and self.speculator is not None:
            raise ConfigError("logprobs=... is not available with speculative decoding; serve without --speculative")
        if params.has_penalties and self.speculator is not None:
            raise ConfigError("penalties, min_tokens and logit_bias are not available with speculative decoding")
        bad_bias = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if bad_bias:
            raise ConfigError(f"logit_bias={{{bad_bias[0]}: ...}}: token id {bad_bias[0]} is out of range, the "
                              f"vocabulary has {self.vocab_size} tokens")
        if params.n > 1 and self.speculator is not None:
            raise ConfigError(f"n={params.n}: several samples are not available with speculative decoding; use n=1")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("this engine has no tokenizer: pass prompts as lists of token ids")
            token_ids, text = self.tokenizer(prompt).input_ids, prompt
        else:
            token_ids, text = [int(t) for t in prompt], None
        if not token_ids:
            raise ConfigError("the prompt is empty: give at least one token")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ConfigError(f"prompt token id {bad[0]} is out of range: the vocabulary has {self.vocab_size} tokens")
        n, window = len(token_ids), self.max_model_len
        if n >= window:
            raise ContextWindowError(f"the prompt has {n} tokens but the context window is {window} tokens; "
                                     "shorten the prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else window - n
        if n + max_tokens > window:
            raise ContextWindowError(f"the prompt has {n} tokens and max_tokens is {max_tokens}: {n + max_tokens} "
                                     f"tokens do not fit the context window of {window}; lower max_tokens")
        capacity = self.capacity_tokens()
        if capacity is not None and n + max_tokens - 1 > capacity:
            raise ConfigError(f"a request of {n} prompt tokens and max_tokens {max_tokens} needs more than the "
                              f"{capacity} tokens the KV cache pool holds; raise --num-blocks or lower max_tokens")
        has_max_tokens = params.max_tokens is not None
        if not has_max_tokens:
            params = SamplingParams(**{**params.__dict__, "max_tokens": max_tokens})
        request_id = request_id or uuid.uuid4().hex
        return Sequence(request_id, next(self._seq_ids), token_ids, params, prompt=text, stream=stream,
                        has_max_tokens=has_max_tokens)

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise ConfigError(f"request id {seq.request_id!r} is already in use")
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        self.num_prompt_tokens += seq.num_prompt_tokens

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, stream: bool = False) -> str:
        seq = self.make_sequence(prompt, params, request_id=request_id, stream=stream)
        self.add(seq)
        return seq.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks (no-op if it already finished)."""
        seq = self.requests.get(request_id)
        if seq is None or all(s.is_finished for s in seq.group or [seq]):
            return None
        for s in seq.group or [seq]:
            if not s.is_finished:
                s.finish("abort")
                self._retire(s)
        return self._output(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ------------------------------------------------------------------------------------------
    # one step
    def step(self) -> list[RequestOutput]:
        """Run one forward pass; returns the outputs of streaming requests that advanced and of finished ones.

        Decode steps replayed from CUDA graphs run one step ahead: the next step is queued on the GPU
        (fed the device-side tokens of the step in flight) before the host reads the tokens of the step
        in flight and does its bookkeeping, so host work overlaps GPU work. With `async_scheduling` any step
        is (`_queue_after`). A sequence that turns out to have finished wasted one queued token, which is dropped.
        """
        if self._in_flight is not None:
            step, self._in_flight = self._in_flight, None
            self._in_flight = self._run_ahead(step) or self._queue_after(step)
            return self._finish(step)
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if not batch:
            return []
        try:
            logits, rows, is_graph, prompt_logits = self.runner.run(batch)
        except CacheCapacityError:  # the estimate missed (e.g. a growth cap): make room and plan again
            self.scheduler.preempt_last()
            return []
        except Exception as exc:  # a failed forward fails its requests, never the engine
            self._fail(batch.seqs, f"{type(exc).__name__}: {exc}")
            return [seq.output(seq.text) for seq in batch.seqs]
        self.num_steps += 1
        for i, rows_logits in prompt_logits.items():
            self._record_prompt_logprobs(batch.seqs[i], rows_logits)
        step = self._sample(batch, [batch.seqs[i] for i in rows], logits, is_graph)
        if step.is_graph:
            self._in_flight = step
            return []
        self._in_flight = self._queue_after(step)
        return self._finish(step)

    def _sample(self, batch: ScheduledBatch, sampled: list[Sequence], logits: torch.Tensor, is_graph: bool) -> "_Step":
        """Queue sampling and the copy of the tokens to the host; nothing waits for the GPU here."""
        if batch.is_verify:
            return self._verify(batch, sampled, logits)
        sampled, logits = self._spawn_samples(sampled, logits)
        tokens = self.sampler.sample(logits, sampled) if sampled else None
        host = event = None
        if tokens is not None and tokens.is_cuda:
            if self._token_buffers is None:
                size = self.config.max_num_seqs
                self._token_buffers = [torch.empty(size, dtype=torch.int64, pin_memory=True) for _ in range(2)]
                self._keep_buffers = [torch.empty(size, dtype=torch.int64, pin_memory=True) for _ in range(2)]
                self._token_events = [torch.cuda.Event() for _ in range(2)]
            turn = self.num_steps % 2  # two steps in flight at most, one of each parity
            host = self._token_buffers[turn][:len(sampled)]
            host.copy_(tokens, non_blocking=True)
            event = self._token_events[turn]
            event.record()
        logprobs = None
        if any(s.params.logprobs is not None for s in sampled):  # reads the tokens now (rare: the API asks)
            logprobs = [token_logprobs(logits[i:i + 1], tokens[i:i + 1], s.params.logprobs)[0]
                        if s.params.logprobs is not None else None for i, s in enumerate(sampled)]
        return _Step(batch, sampled, tokens, host, event, is_graph, logprobs=logprobs)

    def _spawn_samples(self, sampled: list[Sequence], logits: torch.Tensor) -> tuple[list[Sequence], torch.Tensor]:
        """A request of n > 1 samples drawing its first token: its other n - 1 samples draw theirs from the same
        logits row (each with its own generator), and join the running ones when the step finishes."""
        if not any(s.params.n > 1 and s.group is None for s in sampled):
            return sampled, logits
        seqs, rows = [], []
        for i, seq in enumerate(sampled):
            seqs.append(seq)
            rows.append(i)
            if seq.params.n > 1 and seq.group is None:
                group = [seq] + [seq.spawn(k, next(self._seq_ids)) for k in range(1, seq.params.n)]
                for s in group:
                    s.group = group
                seqs.extend(seq.group[1:])
                rows.extend([i] * (seq.params.n - 1))
        return seqs, logits[torch.tensor(rows, device=logits.device)]  # [len(seqs), vocab]

    def _output(self, seq: Sequence) -> RequestOutput:
        """The output of `seq`'s request: with n samples, each one's (finished when the last one is)."""
        if seq.group is None:
            return seq.output(self.detokenizer.visible_text(seq))
        outs = [s.output(self.detokenizer.visible_text(s)) for s in seq.group]
        out = outs[0]
        out.outputs = [o.outputs[0] for o in outs]
        out.finished = all(o.finished for o in outs)
        out.error = next((o.error for o in outs if o.error), None)
        return out

    def _record_prompt_logprobs(self, seq: Sequence, logits: torch.Tensor) -> None:
        """logits: [rows, vocab], the predictions of seq's prompt tokens from position num_computed_tokens + 1 on
        (a recomputed chunk after a preemption records nothing twice)."""
        first = seq.num_computed_tokens + 1
        assert len(seq.prompt_logprobs) >= first, "prompt chunks run in order, from the first token"
        targets = seq.token_ids[first:first + len(logits)]
        entries = token_logprobs(logits, torch.tensor(targets), seq.params.prompt_logprobs)
        seq.prompt_logprobs.extend(entries[len(seq.prompt_logprobs) - first:])

    def _run_ahead(self, step: "_Step") -> "_Step | None":
        """Queue the decode step after `step` (still in flight), or None when it has to go through the scheduler.

        That is the scheduler's own plan whenever every running sequence decodes and no waiting request
        could be admitted: none waits, the batch is full (`max_num_seqs`), or the pool has no headroom
        for one, as under sustained load.
        """
        running, config = self.scheduler.running, self.config
        if self.speculator is not None and self.speculator.is_active(len(running)):
            return None  # the scheduler's path drafts first
        if (not step.is_graph or self.runner.graphs is None or len(step.sampled) != len(running)
                or self.scheduler.can_admit() or len(running) > config.max_num_batched_tokens):
            return None
        bs = self.cache.block_size
        keep, seqs, new_blocks = [], [], 0
        for i, s in enumerate(step.sampled):
            if not s.is_finished and not self._length_reached(s, len(s.token_ids) + 1):  # once the token lands
                keep.append(i)
                seqs.append(s)
                new_blocks += (s.num_computed_tokens + 1) % bs == 0
        if not seqs or not self.runner.graphs.can_run(len(seqs)) or new_blocks > self.scheduler.free_blocks():
            return None
        input_ids = step.tokens if len(keep) == len(step.sampled) else self._surviving_tokens(step, keep)
        try:
            logits = self.runner.run_ahead(seqs, input_ids)
        except CacheCapacityError:
            return None
        except Exception as exc:  # e.g. a failed re-capture: the scheduler's path runs the step eagerly
            self.runner.disable_graphs(exc)
            return None
        self.num_steps += 1
        self.num_steps_ahead += 1
        return self._sample(ScheduledBatch(seqs, [1] * len(seqs)), seqs, logits, is_graph=True)

    def _queue_after(self, step: "_Step") -> "_Step | None":
        """With `async_scheduling`: schedule and queue the step after `step` (in flight, its tokens not read yet),
        or None when it has to wait for them.

        Each sampled sequence gets PLACEHOLDER as its next token and the scheduler advances `step`'s batch now
        (`after_step` reads no sampled token), so the next batch is planned as if the tokens had arrived; the
        model runner fills their input rows from the device-side tokens. A sequence whose token ends it
        (max_tokens or the context window, as surely as it gets one) sits the step out; one that turns out to stop
        (a stop token) computed one token in vain, dropped by `_finish`. Not with speculative decoding (verify
        steps read their tokens on the host), nor for sequences that sample n > 1, want log-probabilities or have
        penalties (their state reads the host's tokens).
        """
        if not self.async_scheduling or self.speculator is not None or step.accepted is not None:
            return None
        live = [s for s in step.sampled if not s.is_finished]
        if any(s.params.n > 1 or s.group is not None or s.params.logprobs is not None or s.params.has_penalties
               for s in live):
            return None
        step.placeholders = []
        for seq in step.sampled:
            step.placeholders.append(-1 if seq.is_finished else len(seq.token_ids))
            if not seq.is_finished:
                seq.token_ids.append(PLACEHOLDER)
        self.scheduler.after_step(step.batch)
        # sequences that end with this token sit the next step out (its plan is made without them)
        ending = {id(s) for s in live if self._length_reached(s, len(s.token_ids))}
        running = self.scheduler.running
        before = list(running)
        running[:] = [s for s in running if id(s) not in ending]
        try:
            batch = self.scheduler.schedule()
        finally:
            planned, old = {id(s) for s in running}, {id(s) for s in before}
            running[:] = ([s for s in before if id(s) in ending or id(s) in planned]
                          + [s for s in running if id(s) not in old])
        if not batch:
            return None
        sources = {id(s): i for i, s in enumerate(step.sampled) if step.placeholders[i] >= 0}
        try:
            logits, rows, is_graph, prompt_logits = self.runner.run(
                batch, pending=(step.tokens, sources) if sources else None)
        except CacheCapacityError:  # the estimate missed: make room, and plan again once the tokens are in
            self.scheduler.preempt_last()
            return None
        except Exception as exc:  # a failed forward fails its requests, never the engine
            self._fail(batch.seqs, f"{type(exc).__name__}: {exc}")
            for seq in batch.seqs:   # their tokens in flight are not read (`_finish` skips finished sequences)
                if seq.token_ids[-1] == PLACEHOLDER:
                    seq.token_ids.pop()
            self._carried += [seq.output(seq.text) for seq in batch.seqs]
            return None
        self.num_steps += 1
        self.num_steps_ahead += 1
        for i, rows_logits in prompt_logits.items():
            self._record_prompt_logprobs(batch.seqs[i], rows_logits)
        return self._sample(batch, [batch.seqs[i] for i in rows], logits, is_graph)

    def _surviving_tokens(self, step: "_Step", keep: list[int]) -> torch.Tensor:
        """The in-flight tokens of step.sampled[i] for i in `keep`, gathered on the device without waiting for it."""
        if not step.tokens.is_cuda:
            return step.tokens[torch.tensor(keep)]
        host = self._keep_buffers[(self.num_steps + 1) % 2][:len(keep)]  # the turn of the step being queued
        host.numpy()[:] = keep
        return step.tokens[host.to(step.tokens.device, non_blocking=True)]

    def _finish(self, step: "_Step") -> list[RequestOutput]:
        """Read a step's tokens (waiting for them if need be) and advance its sequences."""
        if step.accepted is not None:
            return self._finish_verify(step)
        if step.tokens is None:
            tokens = []
        elif step.event is not None:
            step.event.synchronize()
            tokens = step.host.tolist()
        else:
            tokens = step.tokens.tolist()
        if step.placeholders is None:   # else advanced when the next step was queued
            self.scheduler.after_step(step.batch)
        for seq in step.sampled:
            if seq.sample_index and not seq.is_finished and seq.seq_id not in self.cache.seqs:  # spawned this step
                self.scheduler.fork(seq.group[0], seq)
        now = time.perf_counter()
        outputs = []
        for i, (seq, token) in enumerate(zip(step.sampled, tokens)):
            if seq.is_finished:  # aborted, or finished by the step before (a token queued ahead)
                continue
            if step.placeholders is None:
                seq.token_ids.append(token)
            else:
                seq.token_ids[step.placeholders[i]] = token
            if step.logprobs is not None and step.logprobs[i] is not None:
                seq.logprobs.append(step.logprobs[i])
            self.num_generated_tokens += 1
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            finished = self._check_stop(seq, token)
            if finished:
                self._retire(seq)
            if finished or seq.stream:
                out = self._output(seq)
                if out.finished or seq.stream:
                    outputs.append(out)
        if self._carried:
            outputs, self._carried = self._carried + outputs, []
        return list({out.request_id: out for out in outputs}.values())  # n samples: the latest of each request

    def _verify(self, batch: ScheduledBatch, sampled: list[Sequence], logits: torch.Tensor) -> "_Step":
        """A verify step: each sequence's drafted tokens checked against its rows of `logits` (on the host)."""
        drafted = dict(zip(map(id, batch.seqs), batch.num_spec_tokens))
        accepted: list[list[int] | None] = []
        plain, plain_rows = [], []  # sampled sequences without drafts: one token each, sampled together
        row = 0
        for i, seq in enumerate(sampled):
            m = drafted[id(seq)]
            accepted.append(self.speculator.accept(seq, logits[row:row + m + 1], m) if m else None)
            if not m:
                plain.append(i)
                plain_rows.append(row)
            row += m + 1
        if plain:
            rows = logits[torch.tensor(plain_rows, device=logits.device)]
            for i, token in zip(plain, self.sampler.sample(rows, [sampled[i] for i in plain]).tolist()):
                accepted[i] = [token]
        return _Step(batch, sampled, None, None, None, False, accepted=accepted)

    def _finish_verify(self, step: "_Step") -> list[RequestOutput]:
        """Roll back each sequence's rejected drafts, advance it by the accepted ones, then emit its tokens.

        The accepted drafts join token_ids before the scheduler registers full blocks (their keys/values are
        verified); the rejected ones are trimmed from the cache first, so no block holding an unverified
        token is ever registered in the prefix cache.
        """
        batch = step.batch
        index = {id(s): i for i, s in enumerate(batch.seqs)}
        for seq, tokens in zip(step.sampled, step.accepted):
            i = index[id(seq)]
            m = batch.num_spec_tokens[i]
            if seq.is_finished or not m:
                continue
            num_accepted = len(tokens) - 1
            if self.cache.trim(m - num_accepted, seq.seq_id):
                self.runner.rolled_back(seq.seq_id, len(self.cache.seqs[seq.seq_id].block_ids))
            batch.num_new_tokens[i] = 1 + num_accepted
            seq.token_ids.extend(tokens[:-1])
        self.scheduler.after_step(batch)
        now = time.perf_counter()
        outputs = []
        for seq, tokens in zip(step.sampled, step.accepted):
            if seq.is_finished:  # aborted
                continue
            if len(tokens) > 1:
                del seq.token_ids[1 - len(tokens):]  # re-added one by one, with the stop checks
            for token in tokens:
                seq.token_ids.append(token)
                self.num_generated_tokens += 1
                if seq.metrics.first_token_time is None:
                    seq.metrics.first_token_time = now
                if self._check_stop(seq, token):
                    self._retire(seq)
                    break
            if seq.is_finished or seq.stream:
                outputs.append(seq.output(self.detokenizer.visible_text(seq)))
        return outputs

    def _check_stop(self, seq: Sequence, token: int) -> bool:
        """Finish `seq` if its newest token ends it; returns whether it did."""
        params = seq.params
        is_stop_token = (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids
        stop = token if is_stop_token else None
        if seq.stream or params.stop:
            stop_string = self.detokenizer.update(seq)
            stop = stop_string if stop is None else stop
        if stop is not None:
            seq.finish("stop", stop)
            return True
        if self._length_reached(seq, len(seq.token_ids)):
            seq.finish("length")
            return True
        return False

    def _length_reached(self, seq: Sequence, length: int) -> bool:
        """Whether `seq` with `length` tokens has its max_tokens outputs or fills the context window."""
        return length - seq.num_prompt_tokens >= seq.params.max_tokens or length >= self.max_model_len

    def _retire(self, seq: Sequence) -> None:
        if self.speculator is not None:
            self.speculator.forget(seq)
        self.scheduler.finish(seq)
        self.detokenizer.finalize(seq)
        if seq.group is None or all(s.is_finished for s in seq.group):
            self.requests.pop(seq.request_id, None)
            self.num_finished += 1

    def _fail(self, seqs: list[Sequence], message: str) -> None:
        seqs = list({id(s): s for seq in seqs for s in (seq.group or [seq]) if not s.is_finished}.values())
        for seq in seqs:
            seq.error = message
            seq.finish("error")
            if self.speculator is not None:
                self.speculator.forget(seq)
            self.scheduler.finish(seq)
            self.requests.pop(seq.request_id, None)

    # ------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        cache = self.cache
        graphs = self.runner.graphs
        out = {
            "requests_running": len(self.scheduler.running),
            "requests_waiting": len(self.scheduler.waiting),
            "requests_finished": self.num_finished,
            "prompt_tokens": self.num_prompt_tokens,
            "generated_tokens": self.num_generated_tokens,
            "steps": self.num_steps,
            "preemptions": self.scheduler.num_preemptions,
            "blocks_used": cache.pool.num_used,
            "blocks_total": cache.num_blocks,
            "block_size": cache.block_size,
            "kv_format": str(cache.config.kv_format),
            "cuda_graph_replays": graphs.num_replays if graphs else 0,
            "cuda_graph_mixed_replays": self.runner.mixed_graphs.num_replays if self.runner.mixed_graphs else 0,
            "steps_queued_ahead": self.num_steps_ahead,
        }
        out.update(self.prefix.as_dict())
        if self.speculator is not None:
            out.update(self.speculator.stats())
        return out
