"""The OpenAI-compatible request bodies (pydantic) and the responses built from `RequestOutput`s."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .outputs import CompletionOutput, RequestOutput, TokenLogprob
from .sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams


# OpenAI fields this server does not implement, accepted only at the value that means "off" (clients send
# them explicitly, often as null); any other value is refused by name, as is any field not declared here.
_OFF_VALUES = {"suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none", "auto"),
               "response_format": (None, {"type": "text"})}


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # ranges as `SamplingParams` checks them, declared here too so that /openapi.json states them
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    seed: int | None = Field(None, ge=-2**63, lt=2**64)
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    ignore_eos: bool = False
    user: str | None = None  # accepted, no effect (OpenAI clients send it for abuse monitoring)
    metadata: dict | None = None  # accepted, no effect
    store: bool | None = None  # accepted, no effect
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    min_tokens: int = Field(0, ge=0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None  # token id (a string) -> bias
    tools: list | None = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: bool | None = None  # only meaningful with tools, which must be absent
    response_format: dict | None = None

    @field_validator(*(name for name in _OFF_VALUES if name != "suffix"))
    @classmethod
    def _only_off(cls, value, info):
        if value not in _OFF_VALUES[info.field_name]:
            raise ValueError(f"{info.field_name} is not implemented by this server; leave it out")
        return value

    def sampling_params(self, default_max_tokens: int | None, **logprobs) -> SamplingParams:
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                              stop=self.stop or (), stop_token_ids=self.stop_token_ids or (), max_tokens=max_tokens,
                              ignore_eos=self.ignore_eos, n=self.n, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                              min_tokens=self.min_tokens, logit_bias=self.logit_bias or (), **logprobs)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Request):
    prompt: Union[Annotated[str, Field(min_length=1)], Annotated[list[str], Field(min_length=1)],
                  Annotated[list[int], Field(min_length=1)], Annotated[list[list[int]], Field(min_length=1)]]
    max_tokens: int | None = 16  # the OpenAI default for completions
    suffix: str | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # alternatives per token (0: the token's own only)
    echo: bool = False  # the prompt before the completion (and its tokens' logprobs)

    @property
    def is_echo_only(self) -> bool:
        """echo with max_tokens=0: the prompt scored, nothing generated."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self, default_max_tokens: int | None, **_) -> SamplingParams:
        if self.is_echo_only:  # the prefill samples one token anyway; the response leaves it out
            return self.model_copy(update={"max_tokens": 1}).sampling_params(default_max_tokens)
        return super().sampling_params(default_max_tokens, logprobs=self.logprobs,
                                       prompt_logprobs=self.logprobs if self.echo else None)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value:
            raise ValueError("suffix is not implemented by this server; leave it out")
        return value

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict], None] = None
    name: str | None = None  # accepted, no effect (the chat template has no place for it)

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value, info):
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return value

    def sampling_params(self, default_max_tokens: int | None, **_) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(default_max_tokens, logprobs=(self.top_logprobs or 0) if self.logprobs else None)


# ----------------------------------------------------------------------------------------------
# responses
def error_body(message: str, *, param: str | None = None, code: str | None = None,
               kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_logprobs(entries: list[TokenLogprob | None], token_ids: list[int], num_top: int, tokenizer,
                        text_offset: int = 0) -> dict:
    """The completions API's `logprobs` object of `token_ids` (an entry None: the first prompt token)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        text = tokenizer.decode([token_id])
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        token_logprobs.append(None if entry is None else entry.logprob)
        if entry is None:
            top_logprobs.append(None)
            continue
        top = {tokenizer.decode([t]): lp for t, lp in entry.top[:num_top]}
        top.setdefault(text, entry.logprob)  # the chosen token is always listed (as vLLM does)
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def completion_choice(index: int, output: RequestOutput, out: CompletionOutput, req, tokenizer) -> dict:
    """One choice of a completions answer: the echoed prompt (req.echo) and the completion `out`, with logprobs."""
    if req.is_echo_only:
        text, token_ids, entries = "", [], []
    else:
        text, token_ids, entries = out.text, out.token_ids, out.logprobs or []
    if req.echo:
        prompt = output.prompt if output.prompt is not None else tokenizer.decode(output.prompt_token_ids)
        text = prompt + text
        token_ids = output.prompt_token_ids + token_ids
        entries = (output.prompt_logprobs or []) + entries
    logprobs = completion_logprobs(entries, token_ids, req.logprobs, tokenizer) if req.logprobs is not None else None
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason}


def chat_logprobs(entries: list[TokenLogprob], tokenizer) -> dict:
    """The chat API's `logprobs` object: `content`, one item per generated token."""
    def item(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


def completion_response(request_id: str, model: str, outputs: list[RequestOutput], req, tokenizer) -> dict:
    # prompt i's sample k is choice i * n + k (as OpenAI numbers them)
    choices = [completion_choice(i * req.n + c.index, o, c, req, tokenizer) for i, o in enumerate(outputs)
               for c in o.outputs]
    if req.is_echo_only:
        for c in (c for o in outputs for c in o.outputs):
            c.token_ids = []  # the token the prefill sampled is not part of the answer
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(outputs)}


def completion_chunk(request_id: str, model: str, text: str, finish_reason: str | None,
                     logprobs: dict | None = None, index: int = 0) -> dict:
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def chat_response(request_id: str, model: str, output: RequestOutput, tokenizer) -> dict:
    choices = [{"index": out.index, "message": {"role": "assistant", "content": out.text},
                "logprobs": chat_logprobs(out.logprobs, tokenizer) if out.logprobs is not None else None,
                "finish_reason": out.finish_reason} for out in output.outputs]
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage([output])}


def chat_chunk(request_id: str, model: str, delta: dict, finish_reason: str | None,
               logprobs: dict | None = None, index: int = 0) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
