"""Errors pagedkv raises on purpose.

`PagedKVError` subclasses are user mistakes: the message says what was wrong and what would be right.
`CacheCapacityError` is an expected outcome ("does not fit") that callers such as the engine handle.
"""


class PagedKVError(Exception):
    """A user mistake; the message names the setting to change."""


class ConfigError(PagedKVError, ValueError):
    """A bad option value (format string, block size, environment variable)."""


class ModelNotFoundError(PagedKVError, FileNotFoundError):
    """`--model` / `load_model` got something that is not a model."""


class ContextWindowError(PagedKVError):
    """A prompt (or prompt + max new tokens) longer than the context window."""


class CacheMismatchError(PagedKVError):
    """A write whose head_dim, number of KV heads, dtype or device differs from the live cache."""


class CacheCapacityError(Exception):
    """A write needs more blocks than the pool has (and growth is off or capped).

    The cache is left exactly as it was before the write.
    """

    def __init__(self, needed: int, available: int, detail: str = ""):
        self.needed = needed
        self.available = available
        msg = f"paged KV cache is full: this write needs {needed} more blocks but only {available} are available"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class SnapshotError(PagedKVError):
    """A snapshot or a saved cache file that cannot be restored here: another model, page format, block size
    or file version, or a truncated or corrupted file. The cache is left as it was."""


class TierPathError(PagedKVError):
    """A file of the disk tier that resolves outside `kv_cache_dir` (`..` or a symbolic link); it is never read."""
