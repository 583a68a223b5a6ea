"""The decode role: receive prefilled KV, decode in continuous batches, stream tokens."""
