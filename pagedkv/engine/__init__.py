"""The serving engine: continuous batching over one `PagedKVCache`, prefix caching, sampling, CUDA graphs."""

from .config import EngineConfig
from .engine import LLMEngine
from .llm import LLM
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
