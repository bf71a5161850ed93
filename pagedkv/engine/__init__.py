"""The serving engine: continuous batching over one `PagedKVCache`, prefix caching, sampling, CUDA graphs."""

from .config import EngineConfig
from .engine import LLMEngine
from .llm import LLM
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams
from .spec import SpeculativeConfig

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "SpeculativeConfig"]
