"""Policy for when memory is short: compaction passes, spill tiers, the reclaim ladder."""
