"""What the gateway's own ``/metrics`` said at the end of an arm, read before its processes
stop: the counters that explain an arm's figures but that the client cannot see.

- which replica admitted which flow (``fairlane_flow_requests_total``; see
  :mod:`loadtests.bench.replica_flows`);
- which prefix index matched the grants (``fairlane_prefix_matches_total{index}``): an arm
  meant to route on the engines' KV events that matched its grants approximately (events
  not followed, a tokenizer that hashes differently) looks like any other arm in the
  client's figures, and only this count tells.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterable, Iterator, Mapping

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

PREFIX_MATCHES = "fairlane_prefix_matches_total"


def scrape_all(metrics_urls: Mapping[str, str], timeout_s: float = 5.0) -> dict[str, str]:
    """Each process's exposition by its name; one that does not answer is left out (it
    died, and the arm fails on that anyway)."""
    texts: dict[str, str] = {}
    for name, url in metrics_urls.items():
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                texts[name] = response.read().decode()
        except OSError:
            continue
    return texts


def samples(exposition: str, name: str) -> Iterator[Sample]:
    """The samples called ``name`` in one exposition."""
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == name:
                yield sample


def prefix_matches(expositions: Iterable[str]) -> dict[str, int]:
    """Grants by the index that matched their prompt (``precise`` / ``approximate``), summed
    over backends and processes; empty where no grant matched anything."""
    counts: dict[str, int] = {}
    for text in expositions:
        for sample in samples(text, PREFIX_MATCHES):
            index = sample.labels.get("index", "")
            counts[index] = counts.get(index, 0) + int(sample.value)
    return {index: n for index, n in sorted(counts.items()) if n}
