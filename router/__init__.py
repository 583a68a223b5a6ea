"""The router: OpenAI ingress, tokenization, block hashing, placement.

Plain Python: nothing under this package imports torch (docs/architecture.md, "Layout").
"""
