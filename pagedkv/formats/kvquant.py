"""KV-Quant pages: symmetric quantization with one scale per (token, KV head) over the whole head_dim.

Mode q8 / q6 / q4: qmax = 127 / 31 / 7, scale = max(absmax / qmax, 1e-6) in float32,
code = clip(round(x / scale), -qmax, qmax), decoded as code * scale. q8 stores the int8 codes; q6 and
q4 store `code + qmax` packed (`packing`): q4 two 4-bit codes per byte, q6 in two planes (the low 4
bits of every code, then the high 2 bits: `packing.pack_planes`), the same 3 bytes per 4 codes as a
bitstream but with no code split across bytes. Page tensors per KV head: "k" / "v" (codes), "k_scale" /
"v_scale" (one float32).

With `rotate_keys` (`q4:rotate_keys`), keys are first rotated by TurboQuant's randomized Hadamard key
rotation R_k (`hadamard.key_rotation`), which spreads outlier channels over the whole head before the one
scale per token and head is taken; attention rotates queries by the same R_k (q . k is unchanged, values
and outputs are not rotated), and `decode` rotates keys back. Same bytes per token.

The dense mirror of already-decoded tokens (dtype `spec.dtype`) is not part of the pages; it lives in
`pagedkv.mirror` and is fed by `decode`.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .base import PageFormat
from .hadamard import key_rotation, rotate_with
from .packing import pack_bits, pack_planes, packed_width, unpack_bits, unpack_planes

BITS = {"q8": 8, "q6": 6, "q4": 4}
MIN_SCALE = 1e-6


def qmax_of(mode: str) -> int:
    return (1 << (BITS[mode] - 1)) - 1


def quantize_symmetric(x: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] -> codes [..., D] int64 in [-qmax, qmax], scale [..., 1] float32."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / qmax).clamp_min(MIN_SCALE)
    codes = torch.round(xf / scale).clamp(-qmax, qmax).to(torch.int64)
    return codes, scale


class KVQuantFormat(PageFormat):
    page_layout = "2: q6 in two planes"
    def __init__(self, spec, num_kv_heads, head_dim, dtype, device):
        super().__init__(spec, num_kv_heads, head_dim, dtype, device)
        self.bits = BITS[spec.mode]
        self.qmax = qmax_of(spec.mode)
        if (head_dim * self.bits) % 8:
            raise ConfigError(f"KV-Quant {spec.mode} packs {self.bits}-bit codes into whole bytes, which needs "
                              f"head_dim * {self.bits} divisible by 8; head_dim {head_dim} is not (use q8)")
        if spec.rotate_keys and head_dim & (head_dim - 1):
            raise ConfigError(f"KV-Quant rotate_keys needs a power-of-two head_dim (Hadamard rotation); head_dim "
                              f"{head_dim} is not: use --paged-kv-quantization {spec.mode} without rotate_keys")
        # [D] +-1 float32, [D, D] float32 with keys @ key_rotation == R_k keys; None without rotate_keys
        self.key_signs, self.key_rotation = key_rotation(head_dim, self.device) if spec.rotate_keys else (None, None)

    @property
    def mirror_dtype(self) -> torch.dtype:
        """The dtype of the dense mirror (kv_quant_config["dtype"]); the model's dtype when unset."""
        return self.spec.dtype or self.dtype

    def page_spec(self):
        code_dtype = torch.int8 if self.bits == 8 else torch.uint8
        width = packed_width(self.head_dim, self.bits)
        return {"k": (width, code_dtype), "k_scale": (1, torch.float32),
                "v": (width, code_dtype), "v_scale": (1, torch.float32)}

    def _encode_one(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        codes, scale = quantize_symmetric(x, self.qmax)  # [N, H, D], [N, H, 1]
        if self.bits == 8:
            return codes.to(torch.int8), scale
        if self.bits == 6:
            return pack_planes(codes + self.qmax), scale
        return pack_bits(codes + self.qmax, self.bits), scale

    def _decode_one(self, packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.bits == 8:
            codes = packed.float()
        elif self.bits == 6:
            codes = (unpack_planes(packed, self.head_dim) - self.qmax).float()
        else:
            codes = (unpack_bits(packed, self.bits, self.head_dim) - self.qmax).float()
        return (codes * scale.float()).to(dtype or self.dtype)

    def encode(self, key, value):
        if self.key_rotation is not None:
            key = rotate_with(key, self.key_rotation).float()
        k, k_scale = self._encode_one(key)
        v, v_scale = self._encode_one(value)
        return {"k": k, "k_scale": k_scale, "v": v, "v_scale": v_scale}

    def decode(self, parts):
        if self.key_rotation is None:
            return (self._decode_one(parts["k"], parts["k_scale"]), self._decode_one(parts["v"], parts["v_scale"]))
        k, v = self.decode_for_attention(parts)
        return (k.float() @ self.key_rotation.T).to(self.dtype), v

    # rotate_keys: attention runs with keys and queries in the rotated domain (values are not rotated)
    def attention_query(self, query):
        return query if self.key_rotation is None else rotate_with(query, self.key_rotation)

    def decode_for_attention(self, parts):
        if self.key_rotation is None:
            return self.decode(parts)
        k = self._decode_one(parts["k"], parts["k_scale"], torch.float32)
        return k, self._decode_one(parts["v"], parts["v_scale"])
