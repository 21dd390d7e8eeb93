"""deploy/grafana/dashboards/fairlane.json: a valid dashboard about metrics that exist.

- valid JSON, unique panel ids, panels on the 24-column grid without overlaps;
- every panel has the provisioned Prometheus datasource (uid ``prometheus``) and targets;
- every expression parses as PromQL (``promtool check rules`` over the expressions, with
  Grafana's variables replaced the way Grafana interpolates them), names only metrics the
  gateway or vLLM exports, and matches only labels and values they have;
- the template variables' ``label_values`` queries name real metrics and labels, every
  ``$variable`` used is defined, every variable defined is used;
- every metric family the gateway exports appears on the dashboard.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import shutil
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.conftest import REPO, require_tool, run_promtool
from tests.deploy.metric_names import (
    PROMETHEUS_SYNTHETIC,
    bad_matchers,
    envoy_sample_names,
    exported_labels,
    gateway_exposition_text,
    gateway_sample_names,
    promql_metric_names,
    undocumented_envoy_stats,
    unknown_names,
    vllm_sample_names,
)
from tests.polling import until

DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "fairlane.json"
DATASOURCE = {"type": "prometheus", "uid": "prometheus"}

# Variables Grafana defines itself, and what they stand for when checking the PromQL.
BUILTIN_VARIABLES = {
    "__rate_interval": "5m",
    "__interval": "1m",
    "__range": "1h",
    "__interval_ms": "60000",
    "__range_s": "3600",
}
_VAR = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\$(\w+)|\[\[(\w+)(?::[^\]]*)?\]\]")
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(.+?)\s*,\s*)?(\w+)\s*\)\s*$")


def load(path: Path = DASHBOARD) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def all_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows hold their panels


def data_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in all_panels(dashboard) if p["type"] != "row"]


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression: panel targets and annotation queries."""
    exprs = [t["expr"] for p in data_panels(dashboard) for t in p.get("targets", [])]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a]
    return exprs


def variables(dashboard: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def used_variables(dashboard: dict[str, Any]) -> set[str]:
    """Every variable referenced anywhere outside the templating section itself."""
    rest = {k: v for k, v in dashboard.items() if k != "templating"}
    text = json.dumps(rest)
    return {next(g for g in m.groups() if g) for m in _VAR.finditer(text)}


def interpolate(expr: str, dashboard: dict[str, Any]) -> str:
    """``expr`` as Grafana would send it: built-ins to durations, variables to a regex."""
    defined = variables(dashboard)

    def sub(m: re.Match[str]) -> str:
        name = next(g for g in m.groups() if g)
        if name in BUILTIN_VARIABLES:
            return BUILTIN_VARIABLES[name]
        if name in defined:
            return ".*"  # what "All" gives (allValue), and valid inside a regex matcher
        raise AssertionError(f"undefined variable ${name} in {expr!r}")

    return _VAR.sub(sub, expr)


def known_names() -> set[str]:
    return (
        gateway_sample_names() | vllm_sample_names() | envoy_sample_names() | PROMETHEUS_SYNTHETIC
    )


# -- structure ----------------------------------------------------------------------------


def test_valid_json_with_a_stable_identity() -> None:
    dashboard = load()
    assert dashboard["uid"] == "fairlane"
    assert dashboard["title"]
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["id"] is None  # provisioned: Grafana assigns it


def test_rows_are_the_four_views() -> None:
    rows = [p["title"] for p in all_panels(load()) if p["type"] == "row"]
    assert [r.split(":")[0] for r in rows] == [
        "Tier view",
        "Fleet view",
        "Fairness view",
        "Service view",
    ]


def test_panel_ids_are_unique() -> None:
    ids = [p["id"] for p in all_panels(load())]
    assert len(ids) == len(set(ids))


def test_panels_fit_the_grid_without_overlapping() -> None:
    taken: set[tuple[int, int]] = set()
    for p in all_panels(load()):
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        cells = {(g["x"] + dx, g["y"] + dy) for dx in range(g["w"]) for dy in range(g["h"])}
        assert not cells & taken, f"{p['title']} overlaps another panel"
        taken |= cells


@pytest.mark.parametrize("panel", data_panels(load()), ids=lambda p: p["title"])
def test_panel_has_a_datasource_and_targets(panel: dict[str, Any]) -> None:
    assert panel["datasource"] == DATASOURCE
    assert panel.get("description"), "say what the panel shows and how to read it"
    targets = panel.get("targets", [])
    assert targets
    refs = [t["refId"] for t in targets]
    assert len(refs) == len(set(refs))
    for t in targets:
        assert t.get("datasource", DATASOURCE) == DATASOURCE
        assert t["expr"].strip()


# -- expressions --------------------------------------------------------------------------


def test_every_expression_parses(tmp_path: Path) -> None:
    """promtool parses each expression (as a recording rule) after Grafana's interpolation."""
    dashboard = load()
    rules = [
        {"record": f"dashboard:expr_{i}", "expr": interpolate(e, dashboard)}
        for i, e in enumerate(expressions(dashboard))
    ]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = run_promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_metric_on_the_dashboard_is_exported() -> None:
    assert unknown_names(expressions(load()), known_names()) == {}


def test_envoy_stats_on_the_dashboard_are_documented_ones() -> None:
    assert undocumented_envoy_stats(expressions(load())) == {}


def test_every_label_matcher_on_the_dashboard_can_match() -> None:
    assert bad_matchers(expressions(load()), exported_labels()) == {}


def test_every_gateway_metric_family_is_on_the_dashboard() -> None:
    used = set().union(*(promql_metric_names(e) for e in expressions(load())))
    missing = []
    for family in text_string_to_metric_families(gateway_exposition_text()):
        samples = {s.name for s in family.samples if not s.name.endswith("_created")}
        if samples and not samples & used:
            missing.append(family.name)
    assert missing == []


def test_a_made_up_metric_on_the_dashboard_is_caught() -> None:
    dashboard = copy.deepcopy(load())
    panel = data_panels(dashboard)[0]
    panel["targets"][0]["expr"] = 'sum by (tier) (fairlane_queue_depth_typo{tier=~"$tier"})'
    assert unknown_names(expressions(dashboard), known_names())
    panel["targets"][0]["expr"] = "rate(vllm:time_to_first_token_seconds[5m])"  # no _bucket
    assert unknown_names(expressions(dashboard), known_names())


# -- variables ----------------------------------------------------------------------------


@pytest.mark.parametrize("var", load()["templating"]["list"], ids=lambda v: v["name"])
def test_template_variable_query_names_a_real_metric_and_label(var: dict[str, Any]) -> None:
    assert var["type"] == "query"
    assert var["datasource"] == DATASOURCE
    query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
    assert var["definition"] == query
    m = _LABEL_VALUES.match(query)
    assert m is not None, f"expected label_values(metric, label): {query!r}"
    selector, label = m.groups()
    assert selector is not None, "label_values without a metric scans every series"
    labels = exported_labels()
    names = promql_metric_names(selector)
    assert names and names <= known_names()
    for name in names:
        assert label in labels[name], f"{name} has no label {label!r}"
    assert var["includeAll"] and var["allValue"] == ".*"


def test_every_variable_used_is_defined_and_every_defined_one_used() -> None:
    dashboard = load()
    used = used_variables(dashboard)
    defined = set(variables(dashboard))
    assert used - defined - set(BUILTIN_VARIABLES) == set()
    assert defined - used == set()


def test_an_undefined_variable_is_caught() -> None:
    dashboard = copy.deepcopy(load())
    data_panels(dashboard)[0]["targets"][0]["expr"] = 'fairlane_queue_depth{tier=~"$tierz"}'
    assert "tierz" in used_variables(dashboard) - set(variables(dashboard))
    with pytest.raises(AssertionError, match="undefined variable"):
        interpolate(data_panels(dashboard)[0]["targets"][0]["expr"], dashboard)


def test_variables_are_only_used_inside_regex_matchers_or_ranges() -> None:
    """A multi-value variable interpolates to a regex: only ``=~`` can take it."""
    for expr in expressions(load()):
        for m in re.finditer(r'(\w+)\s*(=~|!~|!=|=)\s*"[^"]*\$\{?(\w+)', expr):
            label, op, name = m.groups()
            assert op in ("=~", "!~"), f"{label}{op}${name} in {expr!r}"


# -- what the formulas compute ------------------------------------------------------------


def panel_expr(title: str, ref: str = "A") -> str:
    dashboard = load()
    for p in data_panels(dashboard):
        if p["title"] == title:
            for t in p["targets"]:
                if t["refId"] == ref:
                    return interpolate(t["expr"], dashboard)
    raise KeyError((title, ref))


def test_the_fairness_and_shed_formulas_compute_what_they_say(tmp_path: Path) -> None:
    """promtool evaluates the panels' expressions on made-up series with known answers.

    api: flow a gets 30 tokens/s, flow b 10 (shares 0.75 / 0.25, Jain (40)^2 / (2 * 1000) =
    0.8); batch: two equal flows (Jain 1) plus an idle one (not counted). Shed: interactive
    90 admitted + 10 shed a minute (0.1); batch shed everything and admitted nothing (1);
    api shed nothing (0, not a missing series).
    """
    series = {
        'fairlane_flow_tokens_total{tier="api",flow="a",kind="input"}': "0+600x10",
        'fairlane_flow_tokens_total{tier="api",flow="a",kind="output"}': "0+1200x10",
        'fairlane_flow_tokens_total{tier="api",flow="b",kind="output"}': "0+600x10",
        'fairlane_flow_tokens_total{tier="batch",flow="x",kind="output"}': "0+60x10",
        'fairlane_flow_tokens_total{tier="batch",flow="y",kind="output"}': "0+60x10",
        'fairlane_flow_tokens_total{tier="batch",flow="idle",kind="output"}': "5x10",
        'fairlane_requests_admitted_total{tier="interactive",model="m"}': "0+90x10",
        'fairlane_requests_shed_total{tier="interactive",reason="queue_full"}': "0+10x10",
        'fairlane_requests_shed_total{tier="batch",reason="queue_deadline_exceeded"}': "0+3x10",
        'fairlane_requests_admitted_total{tier="api",model="m"}': "0+50x10",
    }

    def case(expr: str, expected: dict[str, float]) -> dict[str, Any]:
        return {
            "expr": expr,
            "eval_time": "10m",
            "exp_samples": [{"labels": k, "value": v} for k, v in expected.items()],
        }

    tests = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in series.items()],
                "promql_expr_test": [
                    case(
                        panel_expr("Share of tokens by flow, within its tier"),
                        {
                            '{tier="api",flow="a"}': 0.75,
                            '{tier="api",flow="b"}': 0.25,
                            '{tier="batch",flow="x"}': 0.5,
                            '{tier="batch",flow="y"}': 0.5,
                            '{tier="batch",flow="idle"}': 0,
                        },
                    ),
                    case(
                        panel_expr("Jain's fairness index of token service, per tier"),
                        {'{tier="api"}': 0.8, '{tier="batch"}': 1},
                    ),
                    case(
                        panel_expr("Shed ratio"),
                        {'{tier="interactive"}': 0.1, '{tier="batch"}': 1, '{tier="api"}': 0},
                    ),
                ],
            }
        ],
    }
    path = tmp_path / "formulas.test.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    result = run_promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


# -- on a live stack ----------------------------------------------------------------------

# Panels that may rightly be empty after a few seconds of traffic.
# Alerts fire only when something is wrong; the live stack's fleet is fixed addresses, so
# it has no dns:// backend (tests/integration/test_dynamic_fleet.py reads those families).
MAY_BE_EMPTY = {"Firing fairlane alerts", "DNS backends: addresses and failed resolutions"}


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def _query(base: str, expr: str, since: float | None = None) -> list[dict[str, Any]]:
    """An instant query, or with ``since`` a range query from then to now (as a graph)."""
    if since is None:
        url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    else:
        params = {"query": expr, "start": since, "end": time.time(), "step": 1}
        url = f"{base}/api/v1/query_range?" + urllib.parse.urlencode(params)
    result: list[dict[str, Any]] = _get_json(url)["data"]["result"]
    return result


async def _drive(url: str, seconds: float) -> dict[tuple[str, int], int]:
    """Every kind of traffic for ``seconds``: streamed chat, api, a batch flood, bad keys."""
    import aiohttp

    keys = {"interactive": "sk-chat-demo", "api": "sk-api-demo", "batch": "sk-batch-demo"}
    seen: dict[tuple[str, int], int] = {}
    stop = time.monotonic() + seconds

    async def client(session: aiohttp.ClientSession, tier: str, user: int) -> None:
        while time.monotonic() < stop:
            body = {
                "model": "sim-llama-8b",
                "messages": [{"role": "user", "content": f"hello {user} " * 40}],
                "max_tokens": 16,
                "stream": tier == "interactive",
            }
            headers = {"authorization": f"Bearer {keys.get(tier, 'sk-wrong')}"}
            headers["x-user-id"] = f"{tier}-{user}"
            async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
                await r.read()
                seen[(tier, r.status)] = seen.get((tier, r.status), 0) + 1
            await asyncio.sleep(0.05)

    async with aiohttp.ClientSession() as session:
        clients = [client(session, "interactive", i) for i in range(4)]
        clients += [client(session, "api", i) for i in range(4)]
        clients += [client(session, "batch", i) for i in range(30)]
        clients.append(client(session, "nobody", 0))
        await asyncio.gather(*clients)
    return seen


@pytest.mark.integration
def test_every_panel_shows_data_from_a_live_stack(tmp_path: Path, processes: Any) -> None:
    """The real stack (Envoy, two service replicas and their Redis, two simulators)
    scraped by a real Prometheus that loads alerts.yml: after a burst of traffic of every
    kind (and a good and a bad policy reload), every panel's expression returns series.
    Names, labels, ``on (tier)`` matching with the job/instance labels Prometheus adds,
    histogram buckets: all as deployed."""
    from extproc.ops.processes import free_port, wait_http_ready
    from extproc.ops.up import Stack, StackConfig
    from extproc.policy import DEFAULT_POLICY_PATH
    from tests.exported_metrics import parse_samples

    binary = require_tool("prometheus")
    policy = tmp_path / "policy.yaml"
    text = Path(DEFAULT_POLICY_PATH).read_text()
    assert "queue_limit: 100000" in text
    text = text.replace("queue_limit: 100000", "queue_limit: 4")  # batch sheds
    # Each api user may send 30 requests a minute: the budget panels have data.
    assert "    tiers: [api]\n" in text
    text = text.replace(
        "    tiers: [api]\n", "    tiers: [api]\n    user_budget: {requests_per_minute: 30}\n"
    )
    policy.write_text(text)
    # Two replicas sharing a Redis, so the replicas' panels have data too.
    stack = Stack(StackConfig(port=free_port(), policy_path=policy, replicas=2), processes).start()

    prom_port = free_port()
    rules = tmp_path / "alerts.yml"
    shutil.copy(REPO / "deploy" / "prometheus" / "alerts.yml", rules)
    targets = {
        "fairlane": (
            "/metrics",
            [f"127.0.0.1:{p.metrics_port}" for p in stack.service_processes],
        ),
        "envoy": ("/stats/prometheus", [f"127.0.0.1:{stack.admin_port}"]),
        "vllm": ("/metrics", [f"{b.host}:{b.port}" for b in stack.backends]),
    }
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {"job_name": job, "metrics_path": path, "static_configs": [{"targets": hosts}]}
            for job, (path, hosts) in targets.items()
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    prom = processes.start(
        "prometheus",
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ],
    )
    base = f"http://127.0.0.1:{prom_port}"
    wait_http_ready(f"{base}/-/ready", prom, timeout=30)

    def reloaded(result: str) -> bool:
        """Whether every replica has counted a policy reload with ``result``."""
        for service in stack.service_processes:
            url = f"http://127.0.0.1:{service.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as response:
                samples = parse_samples(response.read().decode())
            if not samples.get(("fairlane_policy_reloads_total", frozenset({("result", result)}))):
                return False
        return True

    async def traffic_and_reloads() -> dict[tuple[str, int], int]:
        drive = asyncio.create_task(_drive(stack.url, 12))
        await asyncio.sleep(3)  # traffic under the first policy
        policy.write_text(policy.read_text().replace("priority: 20", "priority: 21"))
        await until(lambda: reloaded("ok"), "every replica to reload the policy", 15.0, 0.1)
        policy.write_text("tiers: [\n")  # rejected: the previous policy stays
        await until(lambda: reloaded("error"), "every replica to refuse the policy", 15.0, 0.1)
        return await drive

    started = time.time()
    seen = asyncio.run(traffic_and_reloads())
    assert seen.get(("batch", 429)), f"the batch flood was never shed: {seen}"
    assert seen.get(("nobody", 401)), seen

    def missing() -> list[str]:
        """What Prometheus does not show yet: a target down, a panel or rule without data."""
        up = {r["metric"]["job"]: r["value"][1] for r in _query(base, "up")}
        found = [] if set(up) == set(targets) and set(up.values()) == {"1"} else [f"up: {up}"]
        dashboard = load()
        for panel in data_panels(dashboard):
            for target in panel["targets"]:
                expr = interpolate(target["expr"], dashboard).replace("[5m]", "[1m]")
                expr = expr.replace(f"[{BUILTIN_VARIABLES['__rate_interval']}]", "[1m]")
                if not _query(base, expr, started) and panel["title"] not in MAY_BE_EMPTY:
                    found.append(f"{panel['title']} / {target['refId']}: {expr}")
        for rule in load_rules_for_live():
            if not _query(base, rule, started):
                found.append(f"recording rule {rule} has no series")
        return found

    # Prometheus scrapes and evaluates every second: what the traffic left shows up within
    # a few rounds.
    deadline = time.monotonic() + 30
    while (empty := missing()) and time.monotonic() < deadline:
        time.sleep(1)
    assert empty == []


def load_rules_for_live() -> list[str]:
    doc = yaml.safe_load((REPO / "deploy" / "prometheus" / "alerts.yml").read_text())
    return [r["record"] for g in doc["groups"] for r in g["rules"] if "record" in r]
