"""Host and disk tiers under the engine's prefix cache (see `prefix.TieredPrefixCache`)."""

from .disk import DiskTier
from .host import HostTier
from .layout import BlockLayout
from .prefix import TieredPrefixCache, TierSettings

__all__ = ["BlockLayout", "DiskTier", "HostTier", "TieredPrefixCache", "TierSettings"]
