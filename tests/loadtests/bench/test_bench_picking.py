"""The endpoint-picking benchmarks' parts: shared-prefix workload, Envoy-only arm kinds,
prefix-cache hit rate from metric snapshots, per-backend overrides and the new targets."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.core.prompt import render_chat, tokenize
from extproc.envoy.binary import validate
from extproc.envoy.params import EnvoyParams
from extproc.fleet.backend import BackendSpec
from loadtests.bench import cpu, report, stats, targets
from loadtests.bench.arms import envoy_only_bootstrap, sim_argv
from loadtests.bench.cachestats import (
    PrefixCounters,
    PrefixWindow,
    parse_prefix_counters,
    window_hit_rate,
)
from loadtests.bench.client import RequestRecord
from loadtests.bench.fifo_bootstrap import render_fifo_bootstrap
from loadtests.bench.results import ArmResult, ArmSummary, BenchResults
from loadtests.bench.scenario import (
    SCENARIO_DIR,
    Dist,
    Group,
    ScenarioError,
    SharedPrefix,
    load_scenario,
    parse_scenario,
)
from loadtests.bench.workload import RequestShape, chat_body, client_shapes

POLICY = SCENARIO_DIR / "policies" / "shared-prefix-x10.yaml"
BLOCK = 16  # the simulators' default --block-size: caching works on whole blocks

SHARED = Group(
    name="chat",
    api_key="sk-chat-demo",
    tenant="chat-app",
    tier="interactive",
    prompt_tokens=Dist("uniform", low=20, high=60),
    max_tokens=Dist("uniform", low=8, high=24),
    concurrency=4,
    shared_prefix=SharedPrefix(
        system_prompts=3,
        system_tokens=Dist("uniform", low=200, high=300),
        turns=Dist("uniform", low=2, high=4),
    ),
)


def tokens(shape: RequestShape, group: Group = SHARED, seed: int = 1) -> list[int]:
    """What the simulator (and the gateway) hash into prefix-cache blocks."""
    body = chat_body(shape, group, seed, "m")
    return tokenize(render_chat(body["messages"]))  # type: ignore[arg-type]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def shapes(client: int, n: int, group: Group = SHARED, seed: int = 1) -> list[RequestShape]:
    return list(itertools.islice(client_shapes(group, seed, client), n))


# --------------------------------------------------------------------------- workload


def test_shared_prefix_workload_is_reproducible_per_seed() -> None:
    first = [chat_body(s, SHARED, 1, "m") for s in shapes(0, 12)]
    assert first == [chat_body(s, SHARED, 1, "m") for s in shapes(0, 12)]
    assert first != [chat_body(s, SHARED, 2, "m") for s in shapes(0, 12, seed=2)]
    assert first != [chat_body(s, SHARED, 1, "m") for s in shapes(1, 12)]


def test_turns_grow_and_resend_the_history() -> None:
    """Each turn's rendered prompt starts with the whole previous turn's prompt, token for
    token: the next turn finds its history in the cache of the backend that served it."""
    seq = shapes(0, 12)
    assert seq[0].conversation == 0 and seq[0].turn == 0
    assert len(tokens(seq[0])) == seq[0].prompt_tokens
    for prev, cur in itertools.pairwise(seq):
        if cur.conversation != prev.conversation:
            assert cur.turn == 0 and cur.conversation == (prev.conversation or 0) + 1
            continue
        assert cur.turn == prev.turn + 1
        a, b = tokens(prev), tokens(cur)
        assert len(b) > len(a) and b[: len(a)] == a
        assert cur.prompt_tokens > prev.prompt_tokens
        assert len(b) == cur.prompt_tokens  # sizes in the records are exact


def test_conversations_share_system_prompts_across_clients() -> None:
    """First turns with the same system prompt share at least its full blocks; with
    different ones, (almost) nothing: the random words diverge within the first words."""
    firsts = [s for c in range(8) for s in shapes(c, 10) if s.turn == 0]
    by_system: dict[str, list[list[int]]] = {}
    for s in firsts:
        body = chat_body(s, SHARED, 1, "m")
        system = body["messages"][0]["content"]  # type: ignore[index]
        by_system.setdefault(system, []).append(tokens(s))
    assert len(by_system) == 3  # every one of the group's system prompts is used
    lists = list(by_system.values())
    for same in lists:
        assert len(same) >= 2
        shared = common_prefix(same[0], same[1])
        assert shared >= 200 and shared // BLOCK >= 12  # the whole system prompt
    assert common_prefix(lists[0][0], lists[1][0]) < BLOCK  # only the template's tag


def test_shared_prefix_needs_closed_loop(tmp_path: Path) -> None:
    data = yaml.safe_load((SCENARIO_DIR / "shared-prefix.yaml").read_text())
    data["policy"] = str(POLICY)
    group = data["groups"][0]
    group.pop("concurrency")
    group["rate"] = 1.0
    group["shared_prefix"]["turns"] = 0
    with pytest.raises(ScenarioError) as err:
        parse_scenario(data, tmp_path / "sp.yaml")
    text = str(err.value)
    assert "groups[0].shared_prefix: needs a closed-loop group" in text
    assert "groups[0].shared_prefix.turns: must be >= 1" in text


# --------------------------------------------------------------------------- arms


@pytest.mark.parametrize("kind", ["least-request", "random"])
def test_envoy_only_arms_render_a_config_envoy_accepts(kind: str, tmp_path: Path) -> None:
    backends = tuple(BackendSpec("127.0.0.1", 18100 + i, "local") for i in range(4))
    params = EnvoyParams(listen_port=18080, admin_port=18081, backends=backends)
    bootstrap = envoy_only_bootstrap(params, kind)
    cluster = bootstrap["static_resources"]["clusters"][0]
    [policy] = cluster["load_balancing_policy"]["policies"]
    name = policy["typed_extension_config"]["name"]
    assert name == f"envoy.load_balancing_policies.{kind.replace('-', '_')}"
    assert "lb_policy" not in cluster
    assert len(cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]) == 4
    # the FIFO render itself is left as it is
    fifo = envoy_only_bootstrap(params, "fifo")
    assert fifo == render_fifo_bootstrap(params)
    path = tmp_path / f"{kind}.yaml"
    path.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
    validate(path)


def test_overrides_reach_one_backend_and_balanced_arms_drop_them() -> None:
    scenario = load_scenario("unbalanced")
    assert dict(scenario.backends.overrides) == {0: ("--num-gpu-blocks", "200")}
    slow = sim_argv(scenario, 9000, "priority", index=0)
    fast = sim_argv(scenario, 9001, "priority", index=1)
    balanced = sim_argv(scenario, 9000, "priority", index=0, balanced=True)
    assert slow[-2:] == ["--num-gpu-blocks", "200"]
    assert "--num-gpu-blocks" not in fast and "--num-gpu-blocks" not in balanced
    arms = {a.name: a for a in scenario.arms}
    assert arms["fairlane-balanced"].balanced and not arms["fairlane-unbalanced"].balanced


def _with_overrides(overrides: Any, tmp_path: Path) -> str:
    data = yaml.safe_load((SCENARIO_DIR / "unbalanced.yaml").read_text())
    data["policy"] = str(SCENARIO_DIR / "policies" / "unbalanced-x20.yaml")
    data["backends"]["overrides"] = overrides
    try:
        parse_scenario(data, tmp_path / "u.yaml")
    except ScenarioError as exc:
        return str(exc)
    return ""


def test_profile_override_is_allowed(tmp_path: Path) -> None:
    assert _with_overrides({0: ["--profile", "llama-70b-h100-tp4"]}, tmp_path) == ""


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({4: ["--max-num-seqs", "4"]}, "backends.overrides.4: must be a backend index in [0, 3]"),
        ({"a": ["--max-num-seqs", "4"]}, "backends.overrides.a: must be a backend index"),
        ({0: []}, "backends.overrides.0: must be a non-empty list of strings"),
        ({0: ["--port", "1"]}, "--port is set by the harness per arm"),
        ({1: ["--num-gpu-blockz", "4"]}, "backends.overrides.1: fairlane sim refuses"),
        ({1: ["--profile", "h200"]}, "fairlane sim refuses --profile h200"),
        ({1: ["--max-num-seqs", "many"]}, "fairlane sim refuses"),
        ([["--max-num-seqs", "4"]], "backends.overrides: must be a mapping"),
    ],
)
def test_bad_overrides_name_the_field(overrides: Any, expected: str, tmp_path: Path) -> None:
    assert expected in _with_overrides(overrides, tmp_path)


# --------------------------------------------------------------------------- hit rate

METRICS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {q}
vllm:prefix_cache_queries_created{{engine="0",model_name="m"}} 1.7e+09
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {h}
vllm:external_prefix_cache_hits_total{{engine="0",model_name="m"}} 99.0
vllm:request_success_total{{engine="0",finished_reason="stop",model_name="m"}} 3.0
vllm:request_success_total{{engine="0",finished_reason="length",model_name="m"}} 4.0
vllm:num_preemptions_total{{engine="0",model_name="m"}} 2.0
"""


def test_parse_prefix_counters() -> None:
    assert parse_prefix_counters(METRICS.format(q="1200.0", h="300.0")) == PrefixCounters(
        1200.0, 300.0, finished=7.0, preemptions=2.0
    )
    with pytest.raises(ValueError, match="prefix_cache_queries_total"):
        parse_prefix_counters("vllm:num_requests_running 1\n")


def test_hit_rate_from_two_snapshots_sums_over_backends() -> None:
    """Token-weighted over the fleet: Δhits / Δqueries summed, not a mean of rates; a failed
    scrape or a restarted backend (counter went down) is left out and counted as missing."""
    start = [PrefixCounters(1000, 100, 5), PrefixCounters(0, 0), PrefixCounters(50, 0), None]
    end = [
        PrefixCounters(3000, 1700, 25, 3),
        PrefixCounters(1000, 100, 10),
        PrefixCounters(10, 0),
        None,
    ]
    window = window_hit_rate(start, end)
    assert (window.queries, window.hits) == (3000, 1700)
    assert window.hit_rate == pytest.approx(1700 / 3000)
    assert (window.backends, window.missing) == (2, 2)
    per = window.to_json()["per_backend"]
    assert [b["finished"] for b in per] == [20, 10, None, None]
    assert per[0]["preemptions"] == 3 and per[0]["hit_rate"] == pytest.approx(0.8)
    assert window_hit_rate([], []).hit_rate is None


# --------------------------------------------------------------------------- targets


def _record(start: float, end: float, ttft: float) -> RequestRecord:
    return RequestRecord(
        arm="a",
        group="chat",
        tenant="chat-app",
        tier="interactive",
        index=0,
        client=0,
        start_s=start,
        prompt_tokens_sent=100,
        max_tokens=10,
        stream=True,
        ttft_s=ttft,
        e2e_s=end - start,
        end_s=end,
        ok=True,
        completion_tokens=10,
    )


def hit_rate(summary: ArmSummary, rate: float | None) -> ArmSummary:
    """``summary`` with a fleet prefix-cache hit rate of ``rate`` (None: no queries)."""
    window = PrefixWindow(1.0, rate, 1, 0) if rate is not None else PrefixWindow(0.0, 0.0, 1, 0)
    return dataclasses.replace(summary, prefix_cache=window)


def test_throughput_and_hit_rate_targets() -> None:
    scenario = load_scenario("shared-prefix")
    window_s = scenario.duration_s - scenario.warmup_s
    fast = [_record(100 + i, 101 + i, 0.5) for i in range(30)]
    slow = [_record(100 + 2 * i, 102 + 2 * i, 1.0) for i in range(10)]
    summaries = {
        "fairlane": hit_rate(stats.arm_summary(scenario, fast), 0.9),
        "least-request": hit_rate(stats.arm_summary(scenario, slow), 0.4),
    }
    total = summaries["fairlane"].total
    assert total.throughput == pytest.approx(30 / window_s)
    assert total.ttft_p90 == pytest.approx(0.5)
    results = {r.target.name: r for r in targets.evaluate(scenario.targets, summaries)}
    throughput = results["throughput >= 1.5x least-request"]
    assert throughput.measured == pytest.approx(3.0) and throughput.passed
    hits = results["prefix-cache hit rate >= 2x least-request"]
    assert hits.measured == pytest.approx(2.25) and hits.passed
    summaries["least-request"] = hit_rate(summaries["least-request"], None)
    [hits] = [r for r in targets.evaluate(scenario.targets, summaries) if r.target.tier is None]
    assert hits.passed is None and hits.note == "no data"


def test_arm_metric_takes_no_selector(tmp_path: Path) -> None:
    data = yaml.safe_load((SCENARIO_DIR / "shared-prefix.yaml").read_text())
    data["policy"] = str(POLICY)
    (hit_rate_target,) = [t for t in data["targets"] if t["metric"] == "prefix_hit_rate"]
    hit_rate_target["tier"] = "interactive"
    with pytest.raises(ScenarioError, match="prefix_hit_rate is measured over the whole fleet"):
        parse_scenario(data, tmp_path / "sp.yaml")


def test_shipped_picking_scenarios_load() -> None:
    shared = load_scenario("shared-prefix")
    assert shared.backends.count == 4
    assert {a.kind for a in shared.arms} == {
        "fairlane",
        "least-request",
        "random",
        "vllm-router-cache",
        "vllm-router-kv",
    }
    group = shared.groups[0]
    assert group.shared_prefix is not None and group.closed_loop
    unbalanced = load_scenario("unbalanced")
    assert any(a.balanced for a in unbalanced.arms)
    assert dataclasses.replace(unbalanced, arms=()).backends.overrides


def test_report_shows_fleet_rows(tmp_path: Path) -> None:
    scenario = load_scenario("unbalanced")
    window = window_hit_rate(
        [PrefixCounters(0, 0, 0), PrefixCounters(0, 0, 0)],
        [PrefixCounters(1000, 250, 40, 7), PrefixCounters(3000, 750, 120)],
    )
    summary = stats.arm_summary(scenario, [_record(100, 110, 10)])
    summary = dataclasses.replace(summary, prefix_cache=window)
    arm = ArmResult(
        kind="fairlane",
        balanced=True,
        groups=["chat"],
        pids={},
        capped=False,
        wall_s=1.0,
        cpu=cpu.CpuUsage(1.0, {}, 0.5, 2),
        summary=summary,
    )
    results = BenchResults(
        scenario={
            "name": "unbalanced",
            "description": "d",
            "duration_s": 600,
            "speedup": 20,
            "warmup_s": 60,
            "seed": 1,
            "max_requests": 10,
            "policy": "p.yaml",
            "backends": {"count": 2, "profile": "x", "flags": [], "overrides": {"0": ["--a"]}},
        },
        arms={"fairlane-balanced": arm},
    )
    text = report.render_markdown(results)
    assert "| prefix-cache hit rate (tokens) | 25.0% (1,000 of 4,000) |" in text
    assert "| requests finished per backend (window) | 40 / 120 |" in text
    assert "| preemptions per backend (window) | 7 / 0 |" in text
    assert "| fleet | balanced |" in text
    assert "backend 0: `--a`" in text
    assert "| throughput (completed req/s) |" in text and "| TTFT p90 (s) |" in text
