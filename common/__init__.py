"""Types the router, the cluster and the engine share, none of which needs torch.

Sampling parameters, block hashing, errors, the grammar spec, the model config and
tokenizer, the engine and speculative settings, KV events and the 8-bit KV format. A leaf:
it imports nothing else of pdserve, and `lint-imports` keeps torch out of it.
"""
