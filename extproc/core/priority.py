"""The continuous vLLM priority number.

vLLM (``--scheduling-policy priority``) runs lower numbers first and breaks ties by arrival.
A tier gives the base number; each request a user already has pending in the engine adds one,
so a power user's fourth request ranks behind another user's first request of the same tier
instead of tying with it and winning by arrival time.
"""

from __future__ import annotations


def vllm_priority(tier_base: int, pending_for_user: int) -> int:
    """Tier base plus the user's count of requests already pending (0 for the first)."""
    return tier_base + max(0, pending_for_user)
