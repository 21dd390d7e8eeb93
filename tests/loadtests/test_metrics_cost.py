"""The scrape-cost benchmark still runs (its figure is in docs/benchmarks/overhead.md), and its
gateway held what it claims: thousands of users and models, yet bounded series."""

import asyncio

from loadtests.metrics_cost import measure


def test_scrape_cost_runs_over_a_full_gateway() -> None:
    result = asyncio.run(measure(held=3000, scrapes=2))
    assert result["held"] + result["in_flight"] == 3000
    assert result["scrape_ms"] > 0
    assert result["series"] < 200  # 3000 users, 500 models: folded into "other"
