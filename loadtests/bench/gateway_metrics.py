"""What the gateway's own ``/metrics`` said at the end of an arm, read before its processes
stop: the counters that explain an arm's figures but that the client cannot see.

- which replica admitted which flow (``fairlane_flow_requests_total``; see
  :mod:`loadtests.bench.replica_flows`);
- which prefix index judged the grants (``fairlane_prefix_matches_total{index}``, one per
  grant, whatever it found) and how many prompt tokens it said the chosen engines held
  (``fairlane_prefix_predicted_tokens_total{index}``): an arm meant to route on the engines'
  KV events whose index was not live (events not followed), or whose predictions fall far
  short of the engines' own hits (a tokenizer that hashes differently), looks like any
  other arm in the client's figures, and only these counts tell.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterable, Iterator, Mapping

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

PREFIX_MATCHES = "fairlane_prefix_matches_total"
PREDICTED_TOKENS = "fairlane_prefix_predicted_tokens_total"


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


def by_index(expositions: Iterable[str], name: str) -> dict[str, int]:
    """Counter ``name`` by its ``index`` label (``precise`` / ``approximate``), summed over
    backends and processes; an index with nothing counted is left out."""
    counts: dict[str, int] = {}
    for text in expositions:
        for sample in samples(text, name):
            index = sample.labels.get("index", "")
            counts[index] = counts.get(index, 0) + int(sample.value)
    return {index: n for index, n in sorted(counts.items()) if n}


def prefix_matches(expositions: Iterable[str]) -> dict[str, int]:
    """Grants by the prefix index that judged them."""
    return by_index(expositions, PREFIX_MATCHES)


def predicted_tokens(expositions: Iterable[str]) -> dict[str, int]:
    """Prompt tokens each index said the chosen engines held."""
    return by_index(expositions, PREDICTED_TOKENS)
