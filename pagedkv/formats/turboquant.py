"""TurboQuant pages: uniform keys per group of 32, Hadamard-rotated Lloyd–Max values.

Keys, per group of 32 consecutive head_dim elements, with an fp16 scale and zero point:
  - q8_0 / int8 (signed): scale = (max - min) / 254, zero = round((max + min) / (2 scale)),
    code = clip(round(x / scale - zero), -127, 127), stored as int8;
  - q5_0, q4_0 / int4, int2 (unsigned b bits): scale = (max - min) / (2^b - 1), zero = round(min / scale),
    code = clip(round(x / scale - zero), 0, 2^b - 1), stored as a packed bitstream;
  decoded as (code + zero) * scale. The scale is rounded up to fp16 (and kept >= amax / 1024) before the
  codes are computed, so the zero point is an exact fp16 integer and every in-range element decodes
  within scale / 2.
  With `rotate_keys`, keys are first rotated by a randomized Hadamard transform R_k (and attention
  rotates queries by the same R_k, so q . k is unchanged).
Values: rotated by R_v over head_dim; per group of 32 an fp16 scale; code = the nearest centroid of
x / scale in the Lloyd–Max codebook of N(0, 1) with 2^bits levels (q2_0 ... q5_0, q8_0), packed as a
little-endian bitstream (3- and 4-bit codes in unit order as code nibbles and sign nibbles, the same bytes,
which the decode kernels look up by byte permutes: `packing.pack_code_nibbles`, `packing.pack_sign_nibbles`);
decoded as centroid * scale. The scale is the group's RMS times the multiple
in SCALE_GRID (0.6 ... 1.4) that gives the group the smallest squared error (the RMS itself on ties):
the codebook fits a standard normal, a group of 32 samples only roughly, and the search lowers the
error by 20-35% at 3-4 bits. Decoding does not depend on how the scale was chosen.
Attention accumulates the rotated values and rotates the output back once.

Page tensors per KV head: "k" (codes), "k_scale", "k_zero" (groups, fp16), "v" (codes), "v_scale".
"""

from __future__ import annotations

import math

import torch

from ..errors import ConfigError
from .base import PageFormat
from .codebook import lloyd_max_codebook, nearest_centroid
from .hadamard import VALUE_SEED, key_rotation, random_signs, rotate_with, rotation_matrix
from .packing import (pack_bits, pack_code_nibbles, pack_sign_nibbles, packed_width, unpack_bits, unpack_code_nibbles,
                      unpack_sign_nibbles)

GROUP = 32
HEAD_DIMS = (64, 128, 256)
KEY_BITS = {"q8_0": 8, "int8": 8, "q5_0": 5, "q4_0": 4, "int4": 4, "int2": 2}
VALUE_BITS = {"q2_0": 2, "q3_0": 3, "q4_0": 4, "q5_0": 5, "q8_0": 8}
ZERO_RANGE = 1024  # |zero| <= ZERO_RANGE keeps zero points exact in fp16
MIN_SCALE = 1e-7
# value scales tried per group, as multiples of the group's RMS (1.0 first: ties keep the RMS)
SCALE_GRID = [1.0] + [round(0.6 + 0.025 * i, 3) for i in range(33) if i != 16]
SEARCH_ELEMENTS = 1 << 22  # candidate codes held at once while searching value scales


def _round_up_fp16(x: torch.Tensor) -> torch.Tensor:
    """The smallest fp16 value >= x (x float32, positive)."""
    h = x.to(torch.float16)
    return torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, float("inf"))), h)


def quantize_keys(x: torch.Tensor, bits: int, signed: bool):
    """x: [..., D] float32 -> codes [..., D] int64, scale [..., D/32] fp16, zero [..., D/32] fp16."""
    g = x.reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)
    hi, lo = g.amax(-1), g.amin(-1)
    levels = 254 if signed else (1 << bits) - 1
    amax = torch.maximum(hi.abs(), lo.abs())
    scale = torch.maximum((hi - lo) / levels, amax / ZERO_RANGE).clamp_min(MIN_SCALE)
    scale16 = _round_up_fp16(scale)
    s = scale16.float()
    zero = torch.round((hi + lo) / (2 * s)) if signed else torch.round(lo / s)
    qmin, qmax = (-127, 127) if signed else (0, levels)
    codes = torch.round(g / s[..., None] - zero[..., None]).clamp(qmin, qmax).to(torch.int64)
    return codes.reshape(x.shape), scale16, zero.to(torch.float16)


def dequantize_keys(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """codes [..., D], scale/zero [..., D/32] -> [..., D] float32."""
    g = codes.float().reshape(*codes.shape[:-1], codes.shape[-1] // GROUP, GROUP)
    return ((g + zero.float()[..., None]) * scale.float()[..., None]).reshape(codes.shape)


class TurboQuantFormat(PageFormat):
    page_layout = "3: 3-bit values as code nibbles, 4-bit values as sign nibbles, both in unit order"

    def __init__(self, spec, num_kv_heads, head_dim, dtype, device):
        super().__init__(spec, num_kv_heads, head_dim, dtype, device)
        if head_dim not in HEAD_DIMS:
            raise ConfigError(f"TurboQuant needs head_dim 64, 128 or 256 (Hadamard rotation, groups of {GROUP}); "
                              f"this model has head_dim {head_dim}: use --paged-kv-quantization q8/q6/q4 or off")
        self.key_bits = KEY_BITS[spec.k_quant]
        self.key_signed = self.key_bits == 8
        self.value_bits = VALUE_BITS[spec.v_quant]
        self.groups = head_dim // GROUP
        self.codebook = lloyd_max_codebook(self.value_bits).to(self.device)  # [2^bits] float32
        self.scale_grid = torch.tensor(SCALE_GRID, dtype=torch.float32, device=self.device)
        self.value_signs = random_signs(head_dim, VALUE_SEED).to(self.device)  # [D] +-1 float32
        # x @ rotation == R x (hadamard.rotate); y @ rotation.T == R^T y
        self.value_rotation = rotation_matrix(self.value_signs)  # [D, D] float32
        self.key_signs, self.key_rotation = key_rotation(head_dim, self.device) if spec.rotate_keys else (None, None)

    def page_spec(self):
        key_dtype = torch.int8 if self.key_signed else torch.uint8
        return {
            "k": (packed_width(self.head_dim, self.key_bits), key_dtype),
            "k_scale": (self.groups, torch.float16),
            "k_zero": (self.groups, torch.float16),
            "v": (packed_width(self.head_dim, self.value_bits), torch.uint8),
            "v_scale": (self.groups, torch.float16),
        }

    # keys ---------------------------------------------------------------------------------------
    def _encode_keys(self, key: torch.Tensor) -> dict[str, torch.Tensor]:
        x = key.float()
        if self.key_rotation is not None:
            x = rotate_with(key, self.key_rotation).float()
        codes, scale, zero = quantize_keys(x, self.key_bits, self.key_signed)
        packed = codes.to(torch.int8) if self.key_signed else pack_bits(codes, self.key_bits)
        return {"k": packed, "k_scale": scale, "k_zero": zero}

    def _decode_keys(self, parts) -> torch.Tensor:
        """Keys in the attention domain (rotated when rotate_keys), float32 [N, H, D]."""
        packed = parts["k"]
        codes = packed if self.key_signed else unpack_bits(packed, self.key_bits, self.head_dim)
        return dequantize_keys(codes, parts["k_scale"], parts["k_zero"])

    # values -------------------------------------------------------------------------------------
    def _encode_values(self, value: torch.Tensor) -> dict[str, torch.Tensor]:
        x = rotate_with(value, self.value_rotation).float()
        g = x.reshape(*x.shape[:-1], self.groups, GROUP)  # [N, H, groups, 32]
        step = max(1, SEARCH_ELEMENTS // (len(SCALE_GRID) * math.prod(g.shape[1:])))  # bounds the search's memory
        pieces = [self._search_value_scales(g[i:i + step]) for i in range(0, max(g.shape[0], 1), step)]
        codes = torch.cat([c for c, _ in pieces])
        scale = torch.cat([s for _, s in pieces])
        return {"v": self._pack_values(codes.reshape(x.shape)), "v_scale": scale}

    def _pack_values(self, codes: torch.Tensor) -> torch.Tensor:
        """3-bit codes go as code nibbles, 4-bit ones as sign nibbles (both in unit order), others as a bitstream."""
        if self.value_bits == 3:
            return pack_code_nibbles(codes)
        return pack_sign_nibbles(codes) if self.value_bits == 4 else pack_bits(codes, self.value_bits)

    def _unpack_values(self, packed: torch.Tensor) -> torch.Tensor:
        if self.value_bits == 3:
            return unpack_code_nibbles(packed, self.head_dim)
        if self.value_bits == 4:
            return unpack_sign_nibbles(packed, self.head_dim)
        return unpack_bits(packed, self.value_bits, self.head_dim)

    def _search_value_scales(self, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """g [n, H, groups, 32] rotated values -> codes (same shape), fp16 scales [n, H, groups]."""
        rms = g.pow(2).mean(-1).sqrt()
        # every candidate scale at once: [M, n, H, groups]
        scale16 = (rms[None] * self.scale_grid.view(-1, *([1] * rms.dim()))).to(torch.float16)
        s = scale16.float()
        s = torch.where(s > 0, s, torch.ones_like(s))[..., None]
        normalized = g[None] / s
        codes = nearest_centroid(normalized, self.codebook)  # [M, n, H, groups, 32]
        err = ((self.codebook[codes] - normalized) * s).pow(2).sum(-1)
        best = err.argmin(0, keepdim=True)  # the first minimum: ties keep the RMS itself
        return codes.gather(0, best[..., None].expand(1, *codes.shape[1:]))[0], scale16.gather(0, best)[0]

    def _decode_values(self, parts) -> torch.Tensor:
        """Values in the rotated domain, float32 [N, H, D]."""
        codes = self._unpack_values(parts["v"])
        g = self.codebook[codes].reshape(*codes.shape[:-1], self.groups, GROUP)
        return (g * parts["v_scale"].float()[..., None]).reshape(codes.shape)

    # protocol -----------------------------------------------------------------------------------
    def encode(self, key, value):
        return {**self._encode_keys(key), **self._encode_values(value)}

    def decode(self, parts):
        k = self._decode_keys(parts)
        if self.key_rotation is not None:
            k = k @ self.key_rotation.T
        v = self._decode_values(parts) @ self.value_rotation.T
        return k.to(self.dtype), v.to(self.dtype)

    def attention_query(self, query):
        if self.key_rotation is None:
            return query
        return rotate_with(query, self.key_rotation)

    def decode_for_attention(self, parts):
        return self._decode_keys(parts), self._decode_values(parts)

    def attention_output(self, out):
        return rotate_with(out, self.value_rotation.T)
