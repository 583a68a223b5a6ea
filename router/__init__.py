"""The router: OpenAI ingress, tokenization, block hashing, Redis prefix index, placement.

Plain Python: nothing under this package imports torch (DESIGN.md, "Layout").
"""

from __future__ import annotations

from pdserve.router.prefix_index import MatchResult, PrefixIndex, ReapResult, WorkerInfo

__all__ = ["MatchResult", "PrefixIndex", "ReapResult", "WorkerInfo"]
