"""A band is one tier's queue: for one pool of engines when the fleet serves several models.

Requests of one tier for different models wait in different bands, so a request whose
model's engines are full never holds back the tier's requests for another model: each band
is placed (gates, seats, reservations) on its own pool's engines, and the scheduler serves
the most urgent band that can go. The flows' virtual counters (VTC) are per band, so per
pool: a token of a 70B model and one of a 7B model cost their engines very differently, and
a tenant's use of one pool says nothing of its fair share of another. On a fleet of one
model, a tier has one band named as the tier, as before.
"""

from __future__ import annotations

SEPARATOR = "@"
"""Between the tier and the pool in a band's name (tier names never contain it)."""


def band_name(tier: str, pool: str) -> str:
    """The band of ``tier`` for ``pool`` ("" : the fleet's only pool, named as the tier)."""
    return f"{tier}{SEPARATOR}{pool}" if pool else tier


def tier_of(band: str) -> str:
    return band.partition(SEPARATOR)[0]


def pool_of(band: str) -> str:
    return band.partition(SEPARATOR)[2]
