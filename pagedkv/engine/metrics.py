"""`/metrics` in the Prometheus text format, from the engine's stats snapshot."""

from __future__ import annotations

# (metric, type, stats key, help)
METRICS = [
    ("pagedkv_requests_running", "gauge", "requests_running", "Requests being generated now."),
    ("pagedkv_requests_waiting", "gauge", "requests_waiting", "Requests waiting to be scheduled (preempted ones included)."),
    ("pagedkv_kv_blocks_used", "gauge", "blocks_used", "KV cache blocks referenced by live sequences."),
    ("pagedkv_kv_blocks_total", "gauge", "blocks_total", "KV cache blocks in the pool."),
    ("pagedkv_prefix_cache_hit_rate", "gauge", "prefix_cache_hit_rate",
     "Fraction of looked-up prompt blocks found in the prefix cache."),
    ("pagedkv_prefix_cache_queries_total", "counter", "prefix_cache_queries", "Prompt blocks looked up in the prefix cache."),
    ("pagedkv_prefix_cache_hits_total", "counter", "prefix_cache_hits", "Prompt blocks found in the prefix cache."),
    ("pagedkv_prefix_cache_hit_tokens_total", "counter", "prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache."),
    ("pagedkv_prefix_cache_evictions_total", "counter", "prefix_cache_evictions", "Cached blocks evicted for reuse."),
    ("pagedkv_tier_gpu_hits_total", "counter", "tier_gpu_hits", "Prompt blocks found in the device pool."),
    ("pagedkv_tier_host_hits_total", "counter", "tier_host_hits", "Prompt blocks loaded from the host tier."),
    ("pagedkv_tier_disk_hits_total", "counter", "tier_disk_hits", "Prompt blocks loaded from the disk tier."),
    ("pagedkv_tier_host_blocks", "gauge", "tier_host_blocks", "Blocks held by the host tier."),
    ("pagedkv_tier_disk_blocks", "gauge", "tier_disk_blocks", "Blocks held by the disk tier."),
    ("pagedkv_tier_disk_bytes", "gauge", "tier_disk_bytes", "Bytes of block files in the disk tier."),
    ("pagedkv_tier_disk_writes_total", "counter", "tier_disk_writes", "Block files written by the disk tier."),
    ("pagedkv_tier_disk_enabled", "gauge", "tier_disk_enabled", "1 while the disk tier is on (a write error turns it off)."),
    ("pagedkv_tier_offloaded_blocks_total", "counter", "tier_offloaded_blocks", "Blocks copied to the host or disk tier."),
    ("pagedkv_prompt_tokens_total", "counter", "prompt_tokens", "Prompt tokens of accepted requests."),
    ("pagedkv_generation_tokens_total", "counter", "generated_tokens", "Tokens generated."),
    ("pagedkv_requests_finished_total", "counter", "requests_finished", "Requests finished (aborted ones included)."),
    ("pagedkv_preemptions_total", "counter", "preemptions", "Running requests preempted to free blocks."),
    ("pagedkv_engine_steps_total", "counter", "steps", "Forward passes run by the engine."),
    ("pagedkv_spec_verify_steps_total", "counter", "spec_verify_steps",
     "Speculative decoding: request steps that verified drafted tokens."),
    ("pagedkv_spec_draft_tokens_total", "counter", "spec_draft_tokens", "Speculative decoding: tokens drafted and verified."),
    ("pagedkv_spec_accepted_tokens_total", "counter", "spec_accepted_tokens", "Speculative decoding: drafted tokens accepted."),
    ("pagedkv_spec_acceptance_rate", "gauge", "spec_acceptance_rate", "Speculative decoding: accepted / drafted tokens."),
    ("pagedkv_spec_accepted_tokens_per_step", "gauge", "spec_accepted_tokens_per_step",
     "Speculative decoding: drafted tokens accepted per verify step of a request."),
]


def render(stats: dict, extra: dict[str, tuple[str, str, float]] | None = None) -> str:
    """The Prometheus exposition text for `stats` (plus `extra`: name -> (type, help, value))."""
    lines = []
    rows = [(name, kind, stats.get(key, 0), help_) for name, kind, key, help_ in METRICS]
    used, total = stats.get("blocks_used", 0), stats.get("blocks_total", 0)
    rows.append(("pagedkv_kv_block_usage", "gauge", used / total if total else 0.0, "Fraction of KV cache blocks in use."))
    for name, (kind, help_, value) in (extra or {}).items():
        rows.append((name, kind, value, help_))
    for name, kind, value, help_ in rows:
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {float(value):g}"]
    return "\n".join(lines) + "\n"
