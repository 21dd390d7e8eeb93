"""Scenarios of several models: what each backend serves (``backends.models``), each group's
``model``, their mistakes with file and line, the shipped ``multi-model`` scenario, what the
client sends and what the report shows per group."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest
from aiohttp import web

from loadtests.bench import cpu, report, stats, targets
from loadtests.bench.arms import sim_argv
from loadtests.bench.cli import scenario_json
from loadtests.bench.client import LoadRun, RequestRecord
from loadtests.bench.results import ArmResult, BenchResults
from loadtests.bench.scenario import SCENARIO_DIR, ScenarioError, load_scenario

POLICY = SCENARIO_DIR / "policies" / "bench-x20.yaml"

# Line numbers below are this text's (1-based); every test edits a copy of it.
GOOD = f"""\
name: two-models
duration_s: 60
speedup: 10
policy: {POLICY}
model: model-a
backends:
  count: 3
  flags: [--max-num-seqs, "8"]
  models: [model-a, [model-b, model-b-alias], model-b]
groups:
  - name: chat-a
    api_key: sk-chat-demo
    tenant: chat-app
    tier: interactive
    rate: 1.0
    prompt_tokens: 100
    max_tokens: 8
  - name: chat-b
    api_key: sk-chat-demo
    tenant: chat-app
    tier: interactive
    model: model-b-alias
    rate: 1.0
    prompt_tokens: 100
    max_tokens: 8
arms:
  - {{name: fifo, kind: fifo}}
  - {{name: fairlane, kind: fairlane}}
targets:
  - name: chat on A
    metric: ttft_p90
    group: chat-a
    arm: fairlane
    max: 1.0
"""
MODELS_LINE = 9
GROUP_A_LINE = 11  # "- name: chat-a": where an error about a field it lacks points
MODEL_B_LINE = 22  # chat-b's "model:"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "two.yaml"
    path.write_text(text)
    return path


def errors_of(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ScenarioError) as info:
        load_scenario(str(path))
    return str(info.value)


def test_models_per_backend_and_per_group(tmp_path: Path) -> None:
    scenario = load_scenario(str(write(tmp_path, GOOD)))
    assert scenario.backends.models == (
        ("model-a",),
        ("model-b", "model-b-alias"),
        ("model-b",),
    )
    assert [scenario.model_of(g) for g in scenario.groups] == ["model-a", "model-b-alias"]
    assert scenario.several_models
    # each backend serves its own names, in every arm (balanced ones too), before the flags
    argvs = [sim_argv(scenario, 9000 + i, "priority", i, balanced=True) for i in range(3)]
    assert argvs[0][-4:] == ["--model", "model-a", "--max-num-seqs", "8"]
    tail = ["--model", "model-b", "--served-model-name", "model-b", "model-b-alias"]
    assert argvs[1][-7:-2] == tail
    assert "--served-model-name" not in argvs[2] and "model-b" in argvs[2]


def test_without_models_every_backend_serves_the_scenario_model(tmp_path: Path) -> None:
    text = GOOD.replace("  models: [model-a, [model-b, model-b-alias], model-b]\n", "")
    text = text.replace("    model: model-b-alias\n", "")
    scenario = load_scenario(str(write(tmp_path, text)))
    assert scenario.backends.models == () and not scenario.several_models
    assert sim_argv(scenario, 9000, "fcfs", 2)[-4:-2] == ["--model", "model-a"]
    # one model for the whole fleet: --model still overrides it
    assert scenario.with_overrides(model="real/name").model == "real/name"


def test_model_override_is_refused_when_models_are_per_backend(tmp_path: Path) -> None:
    scenario = load_scenario(str(write(tmp_path, GOOD)))
    with pytest.raises(ScenarioError, match="--model: the scenario names its models per backend"):
        scenario.with_overrides(model="other")


def test_a_lora_adapter_a_backend_loads_is_served(tmp_path: Path) -> None:
    text = GOOD.replace(
        '  flags: [--max-num-seqs, "8"]\n',
        '  flags: [--max-num-seqs, "8"]\n  overrides: {2: [--enable-lora, --lora-modules, '
        "sql=/adapters/sql]}\n",
    ).replace("model: model-b-alias", "model: sql")
    scenario = load_scenario(str(write(tmp_path, text)))
    assert scenario.model_of(scenario.group("chat-b")) == "sql"


@pytest.mark.parametrize(
    ("old", "new", "line", "expected"),
    [
        (
            "models: [model-a, [model-b, model-b-alias], model-b]",
            "models: [model-a, model-b]",
            MODELS_LINE,
            "backends.models: must name the model of each of the 3 backends (count), got 2",
        ),
        (
            "models: [model-a, [model-b, model-b-alias], model-b]",
            "models: {0: model-a}",
            MODELS_LINE,
            "backends.models: must be a list: one model name per backend",
        ),
        (
            "models: [model-a, [model-b, model-b-alias], model-b]",
            "models:\n    - model-a\n    - []\n    - model-b",
            MODELS_LINE + 2,
            "backends.models[1]: must be a model name or a list of names, got []",
        ),
        (
            "models: [model-a, [model-b, model-b-alias], model-b]",
            "models:\n    - model-a\n    - 7\n    - model-b",
            MODELS_LINE + 2,
            "backends.models[1]: must be a model name or a list of names, got 7",
        ),
        (
            "models: [model-a, [model-b, model-b-alias], model-b]",
            "models:\n    - model-a\n    - [model-b, model-b]\n    - model-b",
            MODELS_LINE + 2,
            "backends.models[1]: names a model twice",
        ),
        (
            "model: model-b-alias",
            "model: model-c",
            MODEL_B_LINE,
            "groups[1].model: 'model-c': no backend serves it (they serve model-a, model-b, "
            "model-b-alias)",
        ),
        (
            "model: model-b-alias",
            'model: ""',
            MODEL_B_LINE,
            "groups[1].model: must be a model name, got ''",
        ),
        (
            "model: model-a\n",
            "model: model-z\n",
            GROUP_A_LINE,
            "groups[0].model: the scenario's model 'model-z': no backend serves it",
        ),
        (
            'flags: [--max-num-seqs, "8"]',
            'flags: [--max-num-seqs, "8", --served-model-name, x]',
            MODELS_LINE - 1,
            "backends.flags: --served-model-name is set by the harness; name the models with "
            "model or backends.models",
        ),
        (
            'flags: [--max-num-seqs, "8"]',
            'flags: [--max-num-seqs, "8"]\n  overrides: {1: [--model, x]}',
            MODELS_LINE,
            "backends.overrides.1: --model is set by the harness; name the models",
        ),
    ],
)
def test_mistakes_name_file_line_and_field(
    old: str, new: str, line: int, expected: str, tmp_path: Path
) -> None:
    assert old in GOOD
    message = errors_of(tmp_path, GOOD.replace(old, new, 1))
    assert f"{tmp_path / 'two.yaml'}:{line}: {expected}" in message, message


def test_a_broken_models_list_does_not_also_blame_the_groups(tmp_path: Path) -> None:
    text = GOOD.replace(
        "models: [model-a, [model-b, model-b-alias], model-b]", "models: [model-a, model-b]"
    )
    message = errors_of(tmp_path, text)
    assert "backends.models" in message and "no backend serves" not in message


# --------------------------------------------------------------------------- the shipped one


def test_the_shipped_multi_model_scenario() -> None:
    scenario = load_scenario("multi-model")
    models = [names for names in scenario.backends.models]
    assert models == [("llama-8b",), ("llama-8b",), ("qwen-7b",), ("qwen-7b",)]
    by_group = {g.name: scenario.model_of(g) for g in scenario.groups}
    assert by_group == {"chat-a": "llama-8b", "chat-b": "qwen-7b", "flood": "qwen-7b"}
    assert {scenario.group(g).tier for g in ("chat-a", "chat-b")} == {"interactive"}
    assert {a.name: a.kind for a in scenario.arms} == {
        "fifo": "fifo",
        "fairlane": "fairlane",
        "fairlane-no-flood": "fairlane",
        "litellm-priority": "litellm-priority",  # the peer that routes by model
    }
    quiet = scenario.groups_of(scenario.arm("fairlane-no-flood"))
    assert [g.name for g in quiet] == ["chat-a", "chat-b"]
    ratios = {t.group: t.bound for t in scenario.targets if t.baseline_arm}
    assert ratios == {"chat-a": 1.1, "chat-b": 3.0}
    assert all(t.arm == "fairlane" for t in scenario.targets)
    assert scenario.policy_rescaled
    # sized for this machine: at most a minute of load per arm
    assert scenario.wall_duration_s <= 60


# --------------------------------------------------------------------------- client, report


async def _engine(seen: Counter[tuple[str, str]]) -> tuple[web.AppRunner, str]:
    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen[(request.headers["x-user-id"], body["model"])] += 1
        return web.json_response({"choices": [{"message": {"content": "ok"}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def test_each_group_sends_its_model(tmp_path: Path) -> None:
    text = GOOD.replace("duration_s: 60", "duration_s: 2\nwarmup_s: 0\ndrain_s: 1")
    text = text.replace("speedup: 10", "speedup: 1").replace("rate: 1.0", "concurrency: 1")
    text = text.replace("    tier: interactive\n", "    tier: interactive\n    stream: false\n")
    text = text.replace("  - name: chat-a\n", "  - name: chat-a\n    user: a\n")
    text = text.replace("  - name: chat-b\n", "  - name: chat-b\n    user: b\n")
    scenario = load_scenario(str(write(tmp_path, text)))
    seen: Counter[tuple[str, str]] = Counter()

    async def run() -> None:
        runner, url = await _engine(seen)
        try:
            await LoadRun(scenario, "fairlane", scenario.groups, url).run()
        finally:
            await runner.cleanup()

    asyncio.run(run())
    assert set(seen) == {("a", "model-a"), ("b", "model-b-alias")}


def _record(group: str, ttft: float, status: int = 200) -> RequestRecord:
    ok = status == 200
    return RequestRecord(
        arm="x",
        group=group,
        tenant="chat-app",
        tier="interactive",
        index=0,
        client=0,
        start_s=20.0,
        prompt_tokens_sent=100,
        max_tokens=8,
        stream=True,
        ttft_s=ttft if ok else None,
        e2e_s=ttft,
        end_s=20.0 + ttft,
        status=status,
        ok=ok,
        prompt_tokens=100 if ok else 0,
        completion_tokens=8 if ok else 0,
    )


def test_targets_and_report_tell_the_groups_of_one_tier_apart() -> None:
    scenario = load_scenario("multi-model")
    records = {
        "fifo": [_record("chat-a", 0.2), _record("chat-a", 0.0, 404), _record("chat-b", 0.3)],
        "fairlane": [_record("chat-a", 0.11), _record("chat-b", 0.9)],
        "fairlane-no-flood": [_record("chat-a", 0.1), _record("chat-b", 0.2)],
    }
    arms = {
        name: ArmResult(
            kind=scenario.arm(name).kind,
            balanced=False,
            groups=[g.name for g in scenario.groups_of(scenario.arm(name))],
            pids={},
            capped=False,
            wall_s=1.0,
            cpu=cpu.CpuUsage(1.0, {}, 0.5, 2),
            summary=stats.arm_summary(scenario, recs),
        )
        for name, recs in records.items()
    }
    verdicts = targets.evaluate(scenario.targets, {n: a.summary for n, a in arms.items()})
    measured = {t.target.group or t.target.tenant: t.measured for t in verdicts}
    assert measured["chat-a"] == pytest.approx(1.1)
    assert measured["chat-b"] == pytest.approx(4.5)
    assert measured["chat-app"] == 0.0
    sc = scenario_json(scenario)
    assert sc["backends"]["models"] == [["llama-8b"], ["llama-8b"], ["qwen-7b"], ["qwen-7b"]]
    assert sc["groups"]["flood"] == {
        "tier": "batch",
        "tenant": "nightly-batch",
        "model": "qwen-7b",
    }
    assert report.groups_sharing_a_tier(sc) == ["chat-a", "chat-b"]
    text = report.render_markdown(BenchResults(scenario=sc, arms=arms, targets=verdicts))
    assert "backend 0: `llama-8b`; backend 1: `llama-8b`; backend 2: `qwen-7b`" in text
    assert "## Groups that share a tier" in text
    assert "| chat-a (interactive, `llama-8b`): errors by status | 404: 1 | 0 | 0 |" in text
    assert "| chat-b (interactive, `qwen-7b`): TTFT p90 (s) | 0.3 | 0.9 | 0.2 |" in text
    assert "flood (batch" not in text  # alone in its tier: the tier's figures are its own
