"""The core split of a pinned run: CPU lists as the kernel and vLLM write them, the default
split of this process's CPUs, each engine's share, and affinity that children inherit."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from loadtests.bench.pinning import (
    CpuSplit,
    PinningError,
    affinities,
    children_pinned,
    cpu_list_text,
    parse_cpu_list,
    pin_process,
    split_cpus,
)


def test_cpu_lists_read_and_write_as_taskset_and_vllm_take_them() -> None:
    assert parse_cpu_list("0-3,6") == {0, 1, 2, 3, 6}
    assert parse_cpu_list(" 1 ") == {1}
    assert cpu_list_text({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert cpu_list_text({3}) == "3"
    for text in ("0-3,6", "1", "2-9,11-12,15"):
        assert cpu_list_text(parse_cpu_list(text)) == text
    for bad in ("", "a", "3-1", "-1", "1-"):
        with pytest.raises(PinningError):
            parse_cpu_list(bad)


def test_the_default_split_gives_the_gateway_the_last_half_at_most_four() -> None:
    assert split_cpus({0, 1}) == CpuSplit(frozenset({0}), frozenset({1}))
    assert split_cpus({0, 1, 2}) == CpuSplit(frozenset({0, 1}), frozenset({2}))
    eight = split_cpus(range(8))
    assert eight.engine == {0, 1, 2, 3} and eight.gateway == {4, 5, 6, 7}
    many = split_cpus(range(32))
    assert many.gateway == {28, 29, 30, 31} and many.engine == set(range(28))
    # this process's CPUs may be any set (a cgroup, taskset): split what there is
    assert split_cpus({2, 5, 9, 11}) == CpuSplit(frozenset({2, 5}), frozenset({9, 11}))
    with pytest.raises(PinningError, match="needs two"):
        split_cpus({0})


def test_a_side_named_takes_those_cores_and_the_other_side_the_rest() -> None:
    four = range(4)
    assert split_cpus(four, engine=frozenset({0})).gateway == {1, 2, 3}
    assert split_cpus(four, gateway=frozenset({3})).engine == {0, 1, 2}
    both = split_cpus(four, frozenset({0, 1}), frozenset({3}))
    assert both == CpuSplit(frozenset({0, 1}), frozenset({3}))  # CPU 2 left to others
    with pytest.raises(PinningError, match="share CPU 1"):
        split_cpus(four, frozenset({0, 1}), frozenset({1, 2}))
    with pytest.raises(PinningError, match="--gateway-cpus: CPU 7 is not available"):
        split_cpus(four, gateway=frozenset({7}))
    with pytest.raises(PinningError, match="--gateway-cpus: no CPU left"):
        split_cpus(four, engine=frozenset(four))


def test_engines_get_the_engine_cores_dealt_out_in_order() -> None:
    split = CpuSplit(frozenset({0, 1, 2, 3, 4}), frozenset({5}))
    assert split.engine_shares(1) == [{0, 1, 2, 3, 4}]
    assert split.engine_shares(2) == [{0, 1, 2}, {3, 4}]
    assert split.engine_shares(5) == [{0}, {1}, {2}, {3}, {4}]
    one = CpuSplit(frozenset({0}), frozenset({1}))
    assert one.engine_shares(2) == [{0}, {0}]  # more engines than cores: they share


needs_two = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="affinity needs two CPUs to show"
)


@needs_two
def test_a_child_started_inside_runs_on_the_cores_named_and_the_caller_is_restored() -> None:
    before = os.sched_getaffinity(0)
    target = {min(before)}
    code = "import os; print(sorted(os.sched_getaffinity(0)))"
    with children_pinned(target):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == str(sorted(target))
    assert os.sched_getaffinity(0) == before


@needs_two
def test_pinning_the_process_pins_every_thread_and_what_it_starts() -> None:
    before = os.sched_getaffinity(0)
    target = {max(before)}
    ready, done = threading.Event(), threading.Event()
    tid: list[int] = []

    def worker() -> None:
        tid.append(threading.get_native_id())
        ready.set()
        done.wait(30)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert ready.wait(30)
        pin_process(target)
        assert os.sched_getaffinity(0) == target
        assert os.sched_getaffinity(tid[0]) == target  # the thread started before, too
        assert affinities({"me": os.getpid(), "gone": 2**22 + 1}) == {"me": str(max(before))}
    finally:
        pin_process(before)
        done.set()
        thread.join()
    assert os.sched_getaffinity(0) == before
