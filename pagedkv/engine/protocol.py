"""The OpenAI-compatible request bodies (pydantic) and the responses built from `RequestOutput`s."""

from __future__ import annotations

import time
import uuid
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .outputs import RequestOutput
from .sampling_params import SamplingParams


# OpenAI fields this server does not implement, accepted only at the value that means "off" (clients send
# them explicitly, often as null); any other value is refused by name, as is any field not declared here.
_OFF_VALUES = {"presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
               "repetition_penalty": (None, 1), "min_tokens": (None, 0), "suffix": (None, ""),
               "tools": (None, []), "tool_choice": (None, "none", "auto"), "response_format": (None, {"type": "text"})}


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = 1
    ignore_eos: bool = False
    user: str | None = None  # accepted, no effect (OpenAI clients send it for abuse monitoring)
    metadata: dict | None = None  # accepted, no effect
    store: bool | None = None  # accepted, no effect
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    logit_bias: dict | None = None
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

    def sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                              stop=self.stop or (), stop_token_ids=self.stop_token_ids or (), max_tokens=max_tokens,
                              ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Request):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16  # the OpenAI default for completions
    suffix: str | None = None

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

    def sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(default_max_tokens)


# ----------------------------------------------------------------------------------------------
# responses
def error_body(message: str, *, param: str | None = None, code: str | None = None,
               kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_response(request_id: str, model: str, outputs: list[RequestOutput]) -> dict:
    choices = [{"index": i, "text": o.outputs[0].text, "logprobs": None, "finish_reason": o.outputs[0].finish_reason}
               for i, o in enumerate(outputs)]
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(outputs)}


def completion_chunk(request_id: str, model: str, text: str, finish_reason: str | None) -> dict:
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def chat_response(request_id: str, model: str, output: RequestOutput) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": output.outputs[0].text},
              "logprobs": None, "finish_reason": output.outputs[0].finish_reason}
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage([output])}


def chat_chunk(request_id: str, model: str, delta: dict, finish_reason: str | None) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
