"""Scheduling and block management: sequences, the block pool, the KV cache manager, the
scheduler and its step cost model. Plain Python, no torch."""
