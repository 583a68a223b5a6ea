"""The prefill role: prefill a prompt, sample its first token, ship its KV to decode."""
