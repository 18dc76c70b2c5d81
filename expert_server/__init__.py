"""Pool B: one worker process per GPU serving a contiguous shard of routed experts."""
