"""`SpeculativeConfig`: which drafter proposes tokens, how many (k), and when speculation backs off."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ...errors import ConfigError

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings, validated on construction (a bad value raises `ConfigError`).

    method: "ngram" (prompt lookup: the tokens that followed the latest earlier occurrence of the last n
    tokens, n from prompt_lookup_max down to prompt_lookup_min, over prompt and output) or "draft" (a
    smaller causal LM with the same tokenizer, `draft_model`: "default", a folder, a .gguf file or a
    loaded model; `draft_layers` keeps only its first N decoder layers, weights shared).
    num_speculative_tokens (k): tokens drafted per sequence and step at most.
    adaptive: per sequence, draft the k that maximises accepted tokens per unit of verify cost, from its
    acceptance so far (0: the sequence pauses, and probes again later); max_batch_size: at this many
    running sequences or more, nobody speculates (a large batch already keeps the device busy);
    verify_token_cost: the cost of one more verified token per sequence, relative to a decode step,
    at batch 1 (it grows with the batch).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    draft_model: object = None
    draft_layers: int | None = None
    adaptive: bool = True
    max_batch_size: int = 32
    verify_token_cost: float = 0.05

    def __post_init__(self):
        if self.method not in METHODS:
            raise ConfigError(f"speculative method {self.method!r} is unknown: use one of {', '.join(METHODS)}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "max_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"speculative {name}={value!r} must be a positive integer")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"speculative prompt_lookup_min={self.prompt_lookup_min} is larger than "
                              f"prompt_lookup_max={self.prompt_lookup_max}")
        if self.method == "draft" and self.draft_model is None:
            raise ConfigError("speculative method 'draft' needs a draft model: draft_model='default', a folder, "
                              "a .gguf file or a loaded model (e.g. --speculative draft:model=default,layers=8)")
        if self.draft_layers is not None and (not isinstance(self.draft_layers, int) or self.draft_layers < 1):
            raise ConfigError(f"speculative draft_layers={self.draft_layers!r} must be a positive integer")
        if not isinstance(self.verify_token_cost, (int, float)) or self.verify_token_cost < 0:
            raise ConfigError(f"speculative verify_token_cost={self.verify_token_cost!r} must be >= 0")

    @classmethod
    def build(cls, value) -> "SpeculativeConfig | None":
        """From None, a SpeculativeConfig, a dict of fields, or a string "METHOD[:key=value,...]".

        String keys: k (num_speculative_tokens), min / max (prompt lookup n), model, layers, adaptive (0/1),
        max_batch_size, verify_token_cost, e.g. "ngram:k=6,max=3" or "draft:model=default,layers=8,k=4".
        """
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ConfigError(f"unknown speculative option(s) {', '.join(unknown)}: use {', '.join(sorted(known))}")
            return cls(**value)
        if not isinstance(value, str):
            raise ConfigError(f"speculative={value!r}: give 'ngram', 'draft:model=PATH', a dict or a SpeculativeConfig")
        method, _, rest = value.partition(":")
        options = {"method": method.strip()}
        aliases = {"k": "num_speculative_tokens", "min": "prompt_lookup_min", "max": "prompt_lookup_max",
                   "model": "draft_model", "layers": "draft_layers"}
        for item in filter(None, (part.strip() for part in rest.split(","))):
            key, sep, raw = item.partition("=")
            key = aliases.get(key.strip(), key.strip())
            if not sep or key not in {f.name for f in fields(cls)} or key == "method":
                raise ConfigError(f"speculative option {item!r} is not KEY=VALUE with KEY one of "
                                  "k, min, max, model, layers, adaptive, max_batch_size, verify_token_cost")
            options[key] = _parse_value(key, raw.strip())
        return cls(**options)


def _parse_value(key: str, raw: str):
    if key == "draft_model":
        return raw
    if key == "adaptive":
        if raw.lower() not in ("0", "1", "true", "false", "on", "off"):
            raise ConfigError(f"speculative adaptive={raw!r}: use 1/0, true/false or on/off")
        return raw.lower() in ("1", "true", "on")
    try:
        return float(raw) if key == "verify_token_cost" else int(raw)
    except ValueError:
        raise ConfigError(f"speculative {key}={raw!r} must be a number") from None
