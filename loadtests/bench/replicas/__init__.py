"""Benchmarks of replicas sharing state through Redis (issue 14): what the exchange costs."""
