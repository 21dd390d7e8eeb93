"""deploy/prometheus/alerts.yml: valid for Prometheus, unit-tested, and about real metrics.

- ``promtool check rules`` and ``promtool test rules alerts.test.yml`` pass (promtool comes
  from Debian's ``prometheus`` package; without it these tests fail, they do not skip);
- every metric an expression names is exported by the gateway (its real collector after
  requests of every outcome, ``tests/exported_metrics.py``) or by vLLM 0.32 (the
  simulator's real exposition), or recorded by a rule in the same file; label matchers name
  labels those metrics have and values they take;
- every alert has a severity, a summary, a description and a runbook link to a section of
  deploy/prometheus/README.md that exists.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import REPO, require_tool, run_promtool
from tests.deploy.metric_names import (
    bad_matchers,
    envoy_sample_names,
    exported_labels,
    gateway_sample_names,
    undocumented_envoy_stats,
    unknown_names,
    vllm_sample_names,
)

PROM_DIR = REPO / "deploy" / "prometheus"
ALERTS = PROM_DIR / "alerts.yml"
ALERT_TESTS = PROM_DIR / "alerts.test.yml"
RUNBOOK = PROM_DIR / "README.md"

SEVERITIES = {"critical", "warning", "info"}


def load_rules(path: Path = ALERTS) -> list[dict[str, Any]]:
    doc = yaml.safe_load(path.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def alerts() -> list[dict[str, Any]]:
    return [r for r in load_rules() if "alert" in r]


def recorded_names() -> set[str]:
    return {r["record"] for r in load_rules() if "record" in r}


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a file's headings (lower case, punctuation dropped)."""
    anchors: set[str] = set()
    counts: dict[str, int] = {}
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code:
            continue
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m is None:
            continue
        text = re.sub(r"`([^`]*)`", r"\1", m.group(1))
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = counts.get(slug, 0)
        counts[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


# -- promtool -----------------------------------------------------------------------------


def test_promtool_check_rules() -> None:
    result = run_promtool("check", "rules", str(ALERTS), cwd=PROM_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    result = run_promtool("test", "rules", str(ALERT_TESTS), cwd=PROM_DIR)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_unit_test() -> None:
    tests = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
    tested = {
        case["alertname"]
        for test in tests
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    quiet = {
        case["alertname"]
        for test in tests
        for case in test.get("alert_rule_test", [])
        if not case.get("exp_alerts")
    }
    names = {a["alert"] for a in alerts()}
    assert names - tested == set(), "alerts never shown to fire"
    assert names - quiet == set(), "alerts never shown to stay quiet"


TTFT_CMP = "{} on (tier)\n          tier:fairlane_tier_slo_ttft_seconds:max"
STALE_AND = "fairlane_backend_metrics_stale == 1\n          {}"


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ('{tier="batch"} > 1800', '{tier="batch"} > 3600'),
        ("ratio_rate5m > 0.05", "ratio_rate5m > 0.5"),
        (TTFT_CMP.format(">"), TTFT_CMP.format("<")),
        (
            "max by (tier) (fairlane_tier_slo_ttft_seconds)",
            "sum by (tier) (fairlane_tier_slo_ttft_seconds)",
        ),
        (STALE_AND.format("and"), STALE_AND.format("or")),
        ("fairlane_queue_depth > 10", "fairlane_queue_depth > 100"),
        (
            "fairlane_backend_healthy\n            * (1 - fairlane_backend_metrics_stale)",
            "fairlane_backend_healthy",
        ),
        (
            "      or\n          (\n            fairlane_policy_reloads_total",
            "      unless\n          (\n            fairlane_policy_reloads_total",
        ),
    ],
    ids=[
        "starvation-bound",
        "shed-threshold",
        "ttft-direction",
        "slo-summed-over-replicas",
        "stale-or-healthy",
        "queue-floor",
        "usable-ignores-stale",
        "reload-misses-first-failure",
    ],
)
def test_the_unit_tests_catch_a_broken_rule(tmp_path: Path, old: str, new: str) -> None:
    """The unit tests are not vacuous: a rule with a wrong threshold or operator fails them."""
    text = ALERTS.read_text()
    assert old in text
    (tmp_path / "alerts.yml").write_text(text.replace(old, new))
    shutil.copy(ALERT_TESTS, tmp_path / "alerts.test.yml")
    assert run_promtool("check", "rules", "alerts.yml", cwd=tmp_path).returncode == 0
    result = run_promtool("test", "rules", "alerts.test.yml", cwd=tmp_path)
    assert result.returncode != 0, result.stdout


def test_promtool_missing_is_a_failure_with_the_install_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shutil, "which", lambda _name: None)
    with pytest.raises(pytest.fail.Exception) as failed:
        require_tool("promtool")
    message = str(failed.value)
    assert "`promtool` is not installed" in message
    assert "scripts/setup-tools" in message
    assert "apt-get install -y --no-install-recommends prometheus" in message


# -- metric names -------------------------------------------------------------------------


def known_names() -> set[str]:
    return gateway_sample_names() | vllm_sample_names() | envoy_sample_names() | recorded_names()


def test_every_metric_in_the_rules_is_exported() -> None:
    exprs = [r["expr"] for r in load_rules()]
    assert unknown_names(exprs, known_names()) == {}


def test_envoy_stats_in_the_rules_are_documented_ones() -> None:
    exprs = [r["expr"] for r in load_rules()]
    assert undocumented_envoy_stats(exprs) == {}
    assert not undocumented_envoy_stats(["envoy_http_ext_proc_fairlane_streams_failed"])
    assert undocumented_envoy_stats(["rate(envoy_http_ext_proc_fairlane_stream_errors[5m])"])


def test_every_label_matcher_in_the_rules_can_match() -> None:
    exprs = [r["expr"] for r in load_rules()]
    assert bad_matchers(exprs, exported_labels()) == {}


def test_the_rules_read_the_gateway_metrics_they_are_about() -> None:
    """Guards the cross-check itself: the exposition it compares against is the gateway's."""
    gateway = gateway_sample_names()
    for name in (
        "fairlane_time_to_first_byte_seconds_bucket",
        "fairlane_request_duration_seconds_bucket",
        "fairlane_tier_slo_ttft_seconds",
        "fairlane_tier_slo_latency_seconds",
        "fairlane_queue_oldest_wait_seconds",
        "fairlane_queue_depth",
        "fairlane_requests_shed_total",
        "fairlane_requests_admitted_total",
        "fairlane_backend_healthy",
        "fairlane_backend_metrics_stale",
        "fairlane_backend_cooling_off",
        "fairlane_policy_reloads_total",
        "fairlane_requests_rejected_total",
    ):
        assert name in gateway, name


@pytest.mark.parametrize(
    "expr",
    [
        "fairlane_queue_depht > 10",  # a typo
        "rate(fairlane_requests_shed[5m])",  # the counter's family name, not its _total
        "histogram_quantile(0.99, rate(fairlane_queue_wait_seconds[5m]))",  # no _bucket
        "fairlane_queue_depth_total",  # a gauge has no _total
        "vllm:num_requests_waiting + vllm_num_requests_running",  # colon vs underscore
        "vllm:gpu_cache_usage_perc",  # removed from vLLM before 0.32
        "envoy_http_ext_proc_streams_failed",  # without fairlane's stat prefix
        "envoy_cluster_upstream_rq_retry_total",  # Envoy's counters carry no _total
    ],
)
def test_a_made_up_metric_name_is_caught(expr: str) -> None:
    assert expr in unknown_names([expr], known_names())


@pytest.mark.parametrize(
    "expr",
    [
        'fairlane_queue_depth{tiers="batch"}',  # no such label
        'fairlane_requests_shed_total{reason="queue-full"}',  # no such value
        'fairlane_requests_rejected_total{reason="internal"}',
    ],
)
def test_a_matcher_that_cannot_match_is_caught(expr: str) -> None:
    assert expr in bad_matchers([expr], exported_labels())


# -- annotations and runbooks -------------------------------------------------------------


def test_alert_names_are_unique() -> None:
    names = [a["alert"] for a in alerts()]
    assert len(names) == len(set(names))


def severity_words(severity: str) -> set[str]:
    """A literal severity, or the words a ``{{ if }}..{{ else }}..{{ end }}`` template yields."""
    return {w for w in re.split(r"\{\{.*?\}\}", severity) if w.strip()}


@pytest.mark.parametrize("alert", alerts(), ids=lambda a: a["alert"])
def test_alert_is_labelled_and_annotated(alert: dict[str, Any]) -> None:
    severity = alert.get("labels", {}).get("severity", "")
    words = severity_words(severity)
    assert words and words <= SEVERITIES, f"severity {severity!r}"
    annotations = alert.get("annotations", {})
    for key in ("summary", "description", "runbook_url"):
        assert annotations.get(key, "").strip(), f"{alert['alert']}: no {key}"


@pytest.mark.parametrize("alert", alerts(), ids=lambda a: a["alert"])
def test_runbook_link_points_at_a_section_of_the_readme(alert: dict[str, Any]) -> None:
    url = alert["annotations"]["runbook_url"]
    path, _, anchor = url.partition("#")
    assert path == "deploy/prometheus/README.md"
    assert anchor == alert["alert"].lower(), "one section per alert, titled with its name"
    assert anchor in github_anchors(RUNBOOK.read_text())


def test_severity_template_words() -> None:
    template = '{{ if eq $labels.tier "interactive" }}critical{{ else }}warning{{ end }}'
    assert severity_words(template) == {"critical", "warning"}
    assert severity_words("warning") == {"warning"}
    assert severity_words("{{ if x }}page{{ end }}") == {"page"}


def test_github_anchors() -> None:
    md = "# Title\n## `FairlaneX` (warning)\n```\n# not a heading\n```\n## Title\n"
    assert github_anchors(md) == {"title", "fairlanex-warning", "title-1"}
