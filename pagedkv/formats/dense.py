"""Dense pages: keys and values stored as they are, in the model's dtype or a chosen one."""

from __future__ import annotations

import torch

from .base import PageFormat


class DenseFormat(PageFormat):
    @property
    def storage_dtype(self) -> torch.dtype:
        return self.spec.dtype or self.dtype

    def page_spec(self):
        return {"k": (self.head_dim, self.storage_dtype), "v": (self.head_dim, self.storage_dtype)}

    def encode(self, key, value):
        return {"k": key.to(self.storage_dtype), "v": value.to(self.storage_dtype)}

    def decode(self, parts):
        return parts["k"].to(self.dtype), parts["v"].to(self.dtype)
