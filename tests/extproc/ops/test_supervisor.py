"""``fairlane up``'s restart decisions (extproc.ops.supervisor): which child is restarted,
when, and how the back-off grows and resets. A fake clock, no processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.ops.supervisor import (
    Action,
    Backoff,
    Restart,
    Role,
    Supervisor,
    action_for,
    restart_line,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def supervisor(clock: Clock) -> Supervisor:
    watched = Supervisor(clock=clock)
    watched.started("service")
    return watched


def test_only_the_service_is_restarted_redis_is_reported_and_the_rest_stop_the_stack() -> None:
    assert action_for(Role.SERVICE) is Action.RESTART
    assert action_for(Role.SHARED_STATE) is Action.REPORT
    assert action_for(Role.ESSENTIAL) is Action.STOP


def test_the_back_off_doubles_from_half_a_second_to_ten() -> None:
    backoff = Backoff()
    assert [backoff.delay(n) for n in range(1, 8)] == [0.5, 1, 2, 4, 8, 10, 10]
    assert backoff.delay(10_000) == 10  # no overflow however long it keeps dying
    with pytest.raises(ValueError):
        backoff.delay(0)


def test_a_dead_service_is_due_for_restart_after_the_first_delay(
    supervisor: Supervisor, clock: Clock
) -> None:
    assert supervisor.due() == [] and supervisor.next_due_in() is None
    clock.now += 60
    restart = supervisor.exited("service")
    assert restart == Restart("service", number=1, delay_s=0.5, due_at=clock.now + 0.5)
    assert supervisor.waiting("service")
    assert supervisor.next_due_in() == 0.5
    clock.now += 0.4
    assert supervisor.due() == []
    clock.now += 0.1
    assert supervisor.due() == [restart]
    assert supervisor.next_due_in() == 0
    assert supervisor.due() == [restart]  # still due until it is started
    supervisor.started("service")
    assert not supervisor.waiting("service")
    assert supervisor.due() == [] and supervisor.next_due_in() is None


def test_asking_again_before_the_restart_gives_the_same_answer(
    supervisor: Supervisor, clock: Clock
) -> None:
    first = supervisor.exited("service")
    clock.now += 0.3
    assert supervisor.exited("service") == first


def test_a_service_that_keeps_dying_waits_longer_each_time(
    supervisor: Supervisor, clock: Clock
) -> None:
    delays = []
    for _ in range(7):
        clock.now += 1  # up for a second only
        restart = supervisor.exited("service")
        delays.append(restart.delay_s)
        clock.now = restart.due_at
        supervisor.started("service")
    assert delays == [0.5, 1, 2, 4, 8, 10, 10]
    assert restart.number == 7


def test_the_back_off_starts_over_once_a_process_stayed_up_thirty_seconds(
    supervisor: Supervisor, clock: Clock
) -> None:
    for _ in range(3):
        clock.now += 1
        restart = supervisor.exited("service")
        clock.now = restart.due_at
        supervisor.started("service")
    assert restart.delay_s == 2
    clock.now += 29.9
    assert supervisor.exited("service").delay_s == 4  # not quite stable yet
    clock.now += 4
    supervisor.started("service")
    clock.now += 30
    restart = supervisor.exited("service")
    assert (restart.delay_s, restart.number) == (0.5, 5)  # the count goes on


def test_replicas_have_schedules_of_their_own(clock: Clock) -> None:
    supervisor = Supervisor(Backoff(first_s=1, factor=3, max_s=100, stable_s=5), clock)
    for name in ("service-r1", "service-r2"):
        supervisor.started(name)
    clock.now += 1
    r1 = supervisor.exited("service-r1")
    clock.now = r1.due_at
    supervisor.started("service-r1")
    clock.now += 1
    assert supervisor.exited("service-r1").delay_s == 3
    r2 = supervisor.exited("service-r2")
    assert (r2.delay_s, r2.number) == (1, 1)
    assert supervisor.next_due_in() == 1
    clock.now += 3
    assert [r.name for r in supervisor.due()] == ["service-r2", "service-r1"]  # earliest first


def test_a_process_never_seen_started_counts_from_its_exit(clock: Clock) -> None:
    supervisor = Supervisor(clock=clock)
    assert supervisor.exited("service").delay_s == 0.5
    assert not supervisor.waiting("service-r9")


def test_the_line_names_the_exit_the_delay_the_count_and_the_dead_process_log() -> None:
    restart = Restart("service", 1, 0.5, 0.0)
    log = Path("/tmp/logs/service.log")
    assert restart_line("the service", "signal SIGKILL", restart, log, others=False) == (
        "fairlane: the service exited (signal SIGKILL); restarting it in 0.5 s "
        "(restart 1; log: /tmp/logs/service.log)"
    )
    line = restart_line("the service-r2", "code 1", Restart("service-r2", 3, 2, 0), log, True)
    assert line.startswith("fairlane: the service-r2 exited (code 1); the other replicas carry on")
    assert "restarting it in 2 s (restart 3;" in line
