"""Settings: `CacheConfig`, the `KVFormat` spec, and the one place the environment is read.

Settings enter once, validated, at the edge (CLI, server, the `PagedKVCache` constructor). The
environment only supplies defaults, and explicit arguments always win over it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import torch

from .errors import ConfigError

KV_QUANT_MODES = ("q8", "q6", "q4")
TURBOQUANT_KEY_QUANTS = ("q8_0", "int8", "q5_0", "q4_0", "int4", "int2")
TURBOQUANT_VALUE_QUANTS = ("q2_0", "q3_0", "q4_0", "q5_0", "q8_0")
KERNEL_CHOICES = ("auto", "triton", "reference")

FORMAT_HELP = (
    "accepted forms: 'off' (dense), 'q8', 'q6', 'q4' (KV-Quant; 'q4:rotate_keys' rotates keys first), "
    "'turboquant' (keys q8_0, values q3_0), "
    "'turboquant:k=<key quant>,v=<value quant>[,rotate_keys]' with key quant one of "
    f"{', '.join(TURBOQUANT_KEY_QUANTS)} and value quant one of {', '.join(TURBOQUANT_VALUE_QUANTS)}; "
    "a quantized format may end in ':recent_tokens=N' (or ',recent_tokens=N' after other options)"
)

_DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}


def parse_dtype(value: str | torch.dtype | None, setting: str = "dtype") -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    try:
        return _DTYPES[str(value).lower()]
    except KeyError:
        raise ConfigError(f"{setting}={value!r} is not a dtype; use one of bf16, fp16, fp32") from None


@dataclass(frozen=True)
class KVFormat:
    """How pages store keys and values.

    kind: "dense" (the model's dtype, or `dtype`), "kvquant" (`mode` q8/q6/q4, dense mirror in `dtype`,
    `rotate_keys`), or "turboquant" (`k_quant`, `v_quant`, `rotate_keys`). `recent_tokens`: the last N tokens of a
    sequence are also kept dense and read from there (0: off; only for quantized kinds).
    """

    kind: str = "dense"
    dtype: torch.dtype | None = None
    mode: str | None = None
    k_quant: str | None = None
    v_quant: str | None = None
    rotate_keys: bool = False
    recent_tokens: int = 0

    def __post_init__(self):
        if isinstance(self.recent_tokens, bool) or not isinstance(self.recent_tokens, int) or self.recent_tokens < 0:
            raise ConfigError(f"recent_tokens={self.recent_tokens!r} must be an integer >= 0 (0 turns the dense window off)")
        if self.kind == "dense" and self.recent_tokens:
            raise ConfigError(f"recent_tokens={self.recent_tokens} needs a quantized format; 'off' pages are dense already")
        if self.kind not in ("dense", "kvquant", "turboquant"):
            raise ConfigError(f"unknown page format kind {self.kind!r}; {FORMAT_HELP}")
        if self.kind == "dense" and self.rotate_keys:
            raise ConfigError("rotate_keys needs a quantized format ('q4:rotate_keys', 'turboquant:...,rotate_keys'); "
                              "'off' pages store keys as they are")
        if self.kind == "kvquant" and self.mode not in KV_QUANT_MODES:
            raise ConfigError(f"KV-Quant mode {self.mode!r} is not one of {', '.join(KV_QUANT_MODES)}")
        if self.kind == "turboquant":
            if self.k_quant not in TURBOQUANT_KEY_QUANTS:
                raise ConfigError(f"TurboQuant key quant {self.k_quant!r} is not accepted; {FORMAT_HELP}")
            if self.v_quant not in TURBOQUANT_VALUE_QUANTS:
                raise ConfigError(f"TurboQuant value quant {self.v_quant!r} is not accepted; {FORMAT_HELP}")

    @property
    def is_dense(self) -> bool:
        return self.kind == "dense"

    @classmethod
    def parse(cls, spec: "str | KVFormat | None") -> "KVFormat":
        """Parse a format string (the same strings as `--paged-kv-quantization`)."""
        if spec is None:
            return cls()
        if isinstance(spec, KVFormat):
            return spec
        if not isinstance(spec, str):
            raise ConfigError(f"page format must be a string, got {type(spec).__name__}; {FORMAT_HELP}")
        text = spec.strip().lower()
        head, _, tail = text.partition(":")
        items, recent = [], 0
        for item in filter(None, (p.strip() for p in tail.split(","))):
            name, eq, value = item.partition("=")
            if name != "recent_tokens":
                items.append(item)
            elif not eq or not value.strip().isdigit():
                raise ConfigError(f"bad option {item!r} in {spec!r}: recent_tokens takes an integer >= 0")
            else:
                recent = int(value)
        if head in ("off", "dense", "none", "") and not items:
            return cls(recent_tokens=recent)
        if head in KV_QUANT_MODES:
            for item in items:
                if item != "rotate_keys":
                    raise ConfigError(f"bad KV-Quant option {item!r} in {spec!r}: {head} takes rotate_keys and "
                                      f"recent_tokens=N (e.g. '{head}:rotate_keys,recent_tokens=128'); {FORMAT_HELP}")
            return cls(kind="kvquant", mode=head, dtype=torch.bfloat16, rotate_keys=bool(items), recent_tokens=recent)
        if head == "turboquant":
            k, v, rotate = "q8_0", "q3_0", False
            for item in items:
                name, eq, value = item.partition("=")
                if name == "rotate_keys" and not eq:
                    rotate = True
                elif name in ("k", "k_quant") and eq:
                    k = value
                elif name in ("v", "v_quant") and eq:
                    v = value
                else:
                    raise ConfigError(f"bad TurboQuant option {item!r} in {spec!r}; {FORMAT_HELP}")
            return cls(kind="turboquant", k_quant=k, v_quant=v, rotate_keys=rotate, recent_tokens=recent)
        raise ConfigError(f"unknown page format {spec!r}; {FORMAT_HELP}")

    @classmethod
    def from_seed_configs(cls, turboquant_config: Mapping | None, kv_quant_config: Mapping | None) -> "KVFormat | None":
        """The seed's `turboquant_config={...}` / `kv_quant_config={...}` dictionaries.

        TurboQuant wins when both are given (the seed routes attention through TurboQuant then); a
        `kv_quant_config` without a mode only sets the dense mirror dtype and means KV-Quant q8.
        """
        if turboquant_config:
            cfg = dict(turboquant_config)
            unknown = set(cfg) - {"k_quant", "v_quant", "rotate_keys"}
            if unknown:
                raise ConfigError(f"unknown turboquant_config keys {sorted(unknown)}; accepted: k_quant, v_quant, rotate_keys")
            return cls(kind="turboquant", k_quant=str(cfg.get("k_quant", "q8_0")).lower(),
                       v_quant=str(cfg.get("v_quant", "q3_0")).lower(), rotate_keys=bool(cfg.get("rotate_keys", False)))
        if kv_quant_config is not None:
            cfg = dict(kv_quant_config)
            unknown = set(cfg) - {"mode", "dtype"}
            if unknown:
                raise ConfigError(f"unknown kv_quant_config keys {sorted(unknown)}; accepted: mode, dtype")
            return cls(kind="kvquant", mode=str(cfg.get("mode", "q8")).lower(),
                       dtype=parse_dtype(cfg.get("dtype", "bf16"), "kv_quant_config['dtype']"))
        return None

    @property
    def page_format(self) -> "KVFormat":
        """This format without its dense recent window: what shapes the pages' bytes (identities, block hashes)."""
        return replace(self, recent_tokens=0)

    def __str__(self) -> str:
        window = f"recent_tokens={self.recent_tokens}" if self.recent_tokens else ""
        if self.kind == "dense":
            return "off"
        if self.kind == "kvquant":
            options = ",".join(filter(None, ("rotate_keys" if self.rotate_keys else "", window)))
            return self.mode + (":" + options if options else "")
        s = f"turboquant:k={self.k_quant},v={self.v_quant}"
        return s + (",rotate_keys" if self.rotate_keys else "") + ("," + window if window else "")


def _env_bool(*names: str) -> bool | None:
    for name in names:
        raw = os.environ.get(name)
        if raw is None or raw.strip() == "":
            continue
        value = raw.strip().lower()
        if value in ("1", "true", "yes", "on"):
            return True
        if value in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"environment variable {name}={raw!r} is not a boolean; use 1/0, true/false, on/off")
    return None


def _env_int(*names: str) -> int | None:
    for name in names:
        raw = os.environ.get(name)
        if raw is None or raw.strip() == "":
            continue
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(f"environment variable {name}={raw!r} is not an integer number of tokens") from None
        if value <= 0:
            raise ConfigError(f"environment variable {name}={raw!r} must be a positive number of tokens")
        return value
    return None


def env_defaults() -> dict[str, Any]:
    """Defaults from the environment (`PAGEDKV_*`, with the seed's `MTPLX_*` names as aliases)."""
    kernels = os.environ.get("PAGEDKV_KERNELS", "").strip().lower() or None
    if kernels is not None and kernels not in KERNEL_CHOICES:
        raise ConfigError(f"PAGEDKV_KERNELS={kernels!r}; use one of {', '.join(KERNEL_CHOICES)}")
    return {
        "dynamic": _env_bool("PAGEDKV_DYNAMIC", "MTPLX_DYNAMIC_PAGED_KV"),
        "context_window_tokens": _env_int("PAGEDKV_CONTEXT_WINDOW_TOKENS", "MTPLX_CONTEXT_WINDOW_TOKENS"),
        "kernels": kernels,
    }


@dataclass(frozen=True)
class CacheConfig:
    """Everything a `PagedKVCache` is configured with. Build it with `CacheConfig.build(...)`."""

    block_size: int = 16
    num_blocks: int = 1024
    dynamic: bool = False
    context_window_tokens: int | None = None
    kv_format: KVFormat = field(default_factory=KVFormat)
    boundary_layers: int = 0
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    kernels: str = "auto"
    num_layers: int | None = None

    def __post_init__(self):
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ConfigError(f"block_size={self.block_size!r} must be a positive integer (16 is the default)")
        if not isinstance(self.num_blocks, int) or self.num_blocks <= 0:
            raise ConfigError(f"num_blocks={self.num_blocks!r} must be a positive integer (1024 is the default)")
        if self.context_window_tokens is not None and self.context_window_tokens <= 0:
            raise ConfigError(f"context_window_tokens={self.context_window_tokens!r} must be positive")
        if self.boundary_layers < 0:
            raise ConfigError(f"boundary_layers={self.boundary_layers!r} must be >= 0")
        if self.kernels not in KERNEL_CHOICES:
            raise ConfigError(f"kernels={self.kernels!r}; use one of {', '.join(KERNEL_CHOICES)}")
        if self.recent_tokens % self.block_size:
            raise ConfigError(f"recent_tokens={self.recent_tokens} must be a multiple of block_size={self.block_size}")

    @property
    def recent_tokens(self) -> int:
        """Tokens per sequence kept dense as well as quantized (0: no window)."""
        return self.kv_format.recent_tokens

    @classmethod
    def build(
        cls,
        *,
        block_size: int = 16,
        num_blocks: int = 1024,
        dynamic: bool | None = None,
        context_window_tokens: int | None = None,
        kv_format: "str | KVFormat | None" = None,
        turboquant_config: Mapping | None = None,
        kv_quant_config: Mapping | None = None,
        boundary_layers: int = 0,
        dtype: "str | torch.dtype | None" = None,
        device: "str | torch.device | None" = None,
        kernels: str | None = None,
        num_layers: int | None = None,
        recent_tokens: int | None = None,
    ) -> "CacheConfig":
        """Validate options; unset ones come from the environment, then from the defaults.

        `recent_tokens` may also come in the format string; given both ways, they must agree.
        """
        env = env_defaults()
        fmt = KVFormat.parse(kv_format)
        seed_fmt = KVFormat.from_seed_configs(turboquant_config, kv_quant_config)
        if seed_fmt is not None:
            if not fmt.is_dense and replace(fmt, recent_tokens=0) != seed_fmt:
                raise ConfigError("give either kv_format or turboquant_config/kv_quant_config, not both")
            fmt = replace(seed_fmt, recent_tokens=fmt.recent_tokens)
        if recent_tokens is not None:
            if fmt.recent_tokens and fmt.recent_tokens != recent_tokens:
                raise ConfigError(f"recent_tokens={recent_tokens} disagrees with the format {str(fmt)!r}; give it once")
            fmt = replace(fmt, recent_tokens=recent_tokens)
        return cls(
            block_size=block_size,
            num_blocks=num_blocks,
            dynamic=bool(dynamic if dynamic is not None else (env["dynamic"] or False)),
            context_window_tokens=context_window_tokens if context_window_tokens is not None else env["context_window_tokens"],
            kv_format=fmt,
            boundary_layers=int(boundary_layers),
            dtype=parse_dtype(dtype),
            device=torch.device(device) if device is not None else None,
            kernels=(kernels or env["kernels"] or "auto").lower(),
            num_layers=num_layers,
        )

    def with_(self, **changes) -> "CacheConfig":
        return replace(self, **changes)

    def layer_format(self, layer_idx: int) -> KVFormat:
        """The format of one layer: boundary layers (first and last N) stay dense."""
        if self.boundary_layers and self.num_layers is not None and not self.kv_format.is_dense:
            n = self.boundary_layers
            if layer_idx < n or layer_idx >= self.num_layers - n:
                return KVFormat(dtype=self.dtype)
        return self.kv_format
