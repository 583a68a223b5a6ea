"""KV block transport from prefill to decode workers: API (`base`), gRPC, UCX, loopback."""
