"""Benchmarks of replicas sharing state through Redis: what the exchange costs."""
