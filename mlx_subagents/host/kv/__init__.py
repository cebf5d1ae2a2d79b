"""The KV room: the pool that owns every KV cache's bytes against one budget (`kv_pool.py`), the bit
widths (`kv_bits.py`) and the caches that batch at them, the shared prefixes held once in memory
(`prefix_cache.py`, `prefixed_cache.py`) and their disk tier (`prefix_store.py`, its folder
`prefix_files.py`)."""
