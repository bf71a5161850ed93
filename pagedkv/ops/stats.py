"""Counters kept by the dispatch layer (`pagedkv.ops`) and the cache; never inside kernels or codecs."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class OpCounters:
    paged_attention_calls: int = 0
    turboquant_attention_calls: int = 0
    kv_quant_attention_calls: int = 0
    fallback_attention_calls: int = 0
    triton_attention_calls: int = 0
    reference_attention_calls: int = 0
    write_calls: int = 0
    bailouts: Counter = field(default_factory=Counter)  # "phase:reason" -> count
    calls_by_phase: Counter = field(default_factory=Counter)  # attention calls: prefill, decode, verify
    cache_write_time_s: float = 0.0
    attention_time_s: float = 0.0

    def reset(self) -> None:
        self.__init__()

    def as_dict(self) -> dict:
        return {
            "paged_attention_calls": self.paged_attention_calls,
            "turboquant_attention_calls": self.turboquant_attention_calls,
            "kv_quant_attention_calls": self.kv_quant_attention_calls,
            "fallback_attention_calls": self.fallback_attention_calls,
            "triton_attention_calls": self.triton_attention_calls,
            "reference_attention_calls": self.reference_attention_calls,
            "paged_attention_bailouts_by_phase_reason": dict(self.bailouts),
            "paged_attention_calls_by_phase": dict(self.calls_by_phase),
            "cache_write_time_s": self.cache_write_time_s,
            "attention_time_s": self.attention_time_s,
        }
