"""`ShardedPagedKVCache`: one rank's pages, for its own KV heads, under block tables that rank 0 decides.

Every rank holds the same block ids; only the heads differ. The leader (rank 0) runs the whole
bookkeeping of a `PagedKVCache` (pool, sequences, prefix sharing, growth) and, after planning a
forward, exports a `CacheStep`: the pool size, the block copies its copy-on-write made, the
per-sequence events of the KV-Quant mirror (freed, trimmed, cleared), and the planned metadata (block
tables, slot mapping, sequence lengths). A follower's cache has no sequences of its own: it applies
the step (grows its pages, copies the same blocks, plays the mirror events) and its layers then write
and attend exactly where the leader's do. A dense recent window (`recent_tokens`) follows the same way:
the plan says which ring rows and slots each step writes and reads, and the step carries the number of
ring rows and the rows the leader's forks copied.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from ..cache import PagedKVCache
from ..ops.metadata import AttentionMetadata, WindowPlan
from ..window import RecentWindow

_MIRROR_EVENTS = ("forget", "trim", "clear")


@dataclass
class CacheStep:
    """What a follower needs to mirror one planned forward of the leader's cache (host objects only)."""

    num_blocks: int                       # the leader's pool size: followers grow their pages to it
    copies: list[tuple[int, int]]         # (src, dst) block copies made since the last step, in order
    mirror_events: list[tuple[str, tuple]]  # (DequantMirror method, args) since the last step, in order
    plan: dict | None                     # AttentionMetadata fields, tensors on the CPU (None: a graph step)
    pending_columns: int                  # positions this forward adds to transformers' view of the cache
    window_rows: int = 0                  # dense recent window: ring rows handed out by the leader
    window_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) ring rows its forks copied


class _RecordingMirror:
    """The cache's KV-Quant mirror, with its per-sequence events recorded for the followers."""

    def __init__(self, inner, events: list):
        self._inner = inner
        self._events = events

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name not in _MIRROR_EVENTS:
            return attr

        def record(*args):
            self._events.append((name, args))
            return attr(*args)

        return record


class _RecordingWindow(RecentWindow):
    """The cache's dense recent window, with the ring rows its forks copy recorded for the followers."""

    def __init__(self, recent_tokens: int, block_size: int, copies: list):
        super().__init__(recent_tokens, block_size)
        self._copies = copies

    def copy_row(self, src: int, dst: int) -> None:
        self._copies.append((src, dst))
        super().copy_row(src, dst)


def _moved(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, WindowPlan):
        return replace(value, **{f.name: getattr(value, f.name).to(device) for f in fields(value)
                                 if isinstance(getattr(value, f.name), torch.Tensor)})
    return value


def _plan_to_host(plan: AttentionMetadata) -> dict:
    return {f.name: _moved(getattr(plan, f.name), "cpu") for f in fields(plan)}


def _plan_on(plan: dict, device: torch.device) -> AttentionMetadata:
    return AttentionMetadata(**{k: _moved(v, device) for k, v in plan.items()})


class ShardedPagedKVCache(PagedKVCache):
    """A `PagedKVCache` whose leader exports each planned step and whose followers apply it.

    Same options as `PagedKVCache`. The leader uses it like any cache (transformers `generate`, the
    engine's `begin_step`); `export_step` and `follow_step` are called by `pagedkv.parallel.step`.
    """

    def __init__(self, config=None, **options):
        super().__init__(config, **options)
        self._copies: list[tuple[int, int]] = []
        self._window_copies: list[tuple[int, int]] = []
        if self.window is not None:
            self.window = _RecordingWindow(self.config.recent_tokens, self.block_size, self._window_copies)
        self._mirror_events: list[tuple[str, tuple]] = []
        self.mirror = _RecordingMirror(self.mirror, self._mirror_events)
        # the ranks that capture and replay this cache's CUDA graphs with it (`pagedkv.parallel.graphs`): set by
        # `lead` on rank 0 when the cache first reaches the followers, and by `follow` on the others
        self.peers = None

    def _copy_on_write(self, seq) -> None:
        src = seq.block_ids[-1]
        super()._copy_on_write(seq)
        self._copies.append((src, seq.block_ids[-1]))

    # ------------------------------------------------------------------------------------------
    # leader
    def export_step(self) -> CacheStep:
        """The planned forward in flight (call between planning and the forward) and the events before it."""
        assert self.plan is not None, "export_step() needs a planned forward: begin_step/begin_forward first"
        step = CacheStep(num_blocks=self.pool.num_blocks, copies=list(self._copies),
                         mirror_events=list(self._mirror_events), plan=_plan_to_host(self.plan),
                         pending_columns=self._pending_columns, **self._window_events())
        self._copies.clear()
        self._mirror_events.clear()
        return step

    def export_events(self) -> CacheStep:
        """The pool size, block copies and mirror events since the last step, without a plan (a CUDA-graph step:
        its block tables and slots reach the followers as device tensors)."""
        step = CacheStep(num_blocks=self.pool.num_blocks, copies=list(self._copies),
                         mirror_events=list(self._mirror_events), plan=None, pending_columns=0,
                         **self._window_events())
        self._copies.clear()
        self._mirror_events.clear()
        return step

    def _window_events(self) -> dict:
        if self.window is None:
            return {}
        events = {"window_rows": self.window.num_rows, "window_copies": list(self._window_copies)}
        self._window_copies.clear()
        return events

    # ------------------------------------------------------------------------------------------
    # follower
    def follow_step(self, step: CacheStep, device: torch.device) -> None:
        """Take the leader's step: same pool size, same block copies, same mirror events, same plan (a step
        without one, from `export_events`, leaves the plan to the caller)."""
        if step.num_blocks != self.pool.num_blocks:
            assert step.num_blocks > self.pool.num_blocks, "the leader's pool never shrinks"
            self._resize(step.num_blocks)
        for src, dst in step.copies:
            for layer_pages in self.pages:
                if layer_pages is not None:
                    for page in layer_pages.values():
                        page[dst].copy_(page[src])
        for name, args in step.mirror_events:
            getattr(self.mirror, name)(*args)
        if self.window is not None:
            self.window.num_rows = max(self.window.num_rows, step.window_rows)
            for src, dst in step.window_copies:
                self.window.copy_row(src, dst)
            self._window_copies.clear()  # a follower exports nothing
        if step.plan is None:
            return
        self.plan = _plan_on(step.plan, device)
        self._plan_is_implicit = False
        self._last_layer_written = -1
        self._pending_columns = step.pending_columns
