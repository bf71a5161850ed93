"""Speculative decoding: drafters behind one interface, verification, adaptive k (see `Speculator`)."""

from .config import SpeculativeConfig
from .drafter import Draft, Drafter
from .speculator import Speculator, make_drafter

__all__ = ["SpeculativeConfig", "Draft", "Drafter", "Speculator", "make_drafter"]
