"""What an arm's gateway is started with (no processes)."""

from __future__ import annotations

import pytest

from extproc.envoy.bootstrap import render_bootstrap
from extproc.envoy.params import EnvoyConfigError, EnvoyParams
from loadtests.bench.arms import SCHEDULING, completion_flush_s, envoy_only_bootstrap


def test_completions_are_batched_for_the_same_simulated_time_at_any_speedup() -> None:
    assert completion_flush_s(1) == EnvoyParams.completion_flush_s
    assert completion_flush_s(0.5) == EnvoyParams.completion_flush_s  # never longer
    assert completion_flush_s(5) == pytest.approx(EnvoyParams.completion_flush_s / 5)
    assert completion_flush_s(1000) == 0.001  # Envoy's smallest: a millisecond


def test_the_flush_interval_reaches_envoys_access_log() -> None:
    hcm = render_bootstrap(EnvoyParams(completion_flush_s=0.002))["static_resources"]["listeners"][
        0
    ]["filter_chains"][0]["filters"][0]["typed_config"]
    completions = hcm["access_log"][0]["typed_config"]["common_config"]
    assert completions["buffer_flush_interval"] == "0.002s"
    with pytest.raises(EnvoyConfigError, match="completion_flush_s"):
        EnvoyParams(completion_flush_s=0)


def test_the_vllm_priority_arm_is_fifos_envoy_in_front_of_priority_engines() -> None:
    params = EnvoyParams()
    assert envoy_only_bootstrap(params, "vllm-priority") == envoy_only_bootstrap(params, "fifo")
    assert (SCHEDULING["fifo"], SCHEDULING["vllm-priority"]) == ("fcfs", "priority")
