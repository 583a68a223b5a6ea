"""The model and its layers: Llama, attention backends, linear layers (bf16/int8),
rotary embeddings, weight loading and the 8-bit KV reference."""
