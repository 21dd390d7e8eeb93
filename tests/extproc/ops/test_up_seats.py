"""What ``fairlane up`` prints about each backend's seats, and how ``--backend`` declares them:
the service's gauge parsed, changes turned into lines (a growing fallback estimate not on
every step), the banner's backend lines, and ``--backend`` errors. No sockets."""

from __future__ import annotations

import pytest

from extproc.fleet.backend import BackendSpec, backend_argument, parse_backend
from extproc.ops import cli
from extproc.ops.seat_watch import FALLBACK_REPORT_S, SeatCount, SeatWatch, parse_seats
from extproc.ops.up import _backend_line
from extproc.transport.server import backends_from_args
from tests.extproc.factories import FakeClock

EXPOSITION = """\
# HELP fairlane_backend_seats Requests the backend's engine runs at once.
# TYPE fairlane_backend_seats gauge
fairlane_backend_seats{backend="127.0.0.1:8101",region="east",source="learned"} 16.0
fairlane_backend_seats{backend="[::1]:8102",region="we\\"st",source="fallback"} 5.0
# TYPE fairlane_backend_seats_total_typo gauge
fairlane_backend_seats_total_typo{backend="127.0.0.1:9"} 3.0
fairlane_fleet_seats 21.0
"""
EAST = "127.0.0.1:8101"


def test_parse_seats_reads_one_count_and_source_per_backend() -> None:
    assert parse_seats(EXPOSITION) == {
        EAST: SeatCount("east", 16, "learned"),
        "[::1]:8102": SeatCount('we"st', 5, "fallback"),
    }
    assert parse_seats("") == {}


def test_a_seat_line_names_region_address_count_and_source() -> None:
    assert SeatCount("east", 4, "learned").line(EAST) == (
        "backend east 127.0.0.1:8101: seats 4 (learned from the engine)"
    )
    assert SeatCount("east", 4, "fallback").line(EAST).endswith("(fallback: not learned yet)")
    assert SeatCount("east", 6, "declared").line(EAST).endswith("seats 6 (declared)")


def watch(shown: dict[str, SeatCount]) -> tuple[SeatWatch, FakeClock]:
    clock = FakeClock(0.0)
    seats = SeatWatch("http://127.0.0.1:9/metrics", clock)
    seats.shown = dict(shown)
    seats.shown_at = dict.fromkeys(shown, 0.0)
    return seats, clock


def test_a_learned_count_and_every_change_of_source_are_printed_at_once() -> None:
    seats, _ = watch({EAST: SeatCount("east", 4, "fallback")})
    assert seats.changes({EAST: SeatCount("east", 4, "fallback")}, 1.0) == []
    learned = SeatCount("east", 16, "learned")
    assert seats.changes({EAST: learned}, 1.0) == [learned.line(EAST)]
    assert seats.changes({EAST: learned}, 2.0) == []  # once
    # the engine restarted with other flags: forgotten, then learned smaller
    forgot = SeatCount("east", 4, "fallback")
    assert seats.changes({EAST: forgot}, 3.0) == [forgot.line(EAST)]
    smaller = SeatCount("east", 2, "learned")
    assert seats.changes({EAST: smaller}, 4.0) == [smaller.line(EAST)]
    raised = SeatCount("east", 3, "learned")
    assert seats.changes({EAST: raised}, 5.0) == [raised.line(EAST)]


def test_a_backend_first_seen_after_start_is_printed() -> None:
    seats, _ = watch({})
    seat = SeatCount("east", 4, "fallback")
    assert seats.changes({EAST: seat}, 0.0) == [seat.line(EAST)]


def test_a_growing_fallback_estimate_is_printed_at_most_every_so_often() -> None:
    seats, _ = watch({EAST: SeatCount("east", 4, "fallback")})
    assert seats.changes({EAST: SeatCount("east", 5, "fallback")}, 1.0) == []
    assert seats.changes({EAST: SeatCount("east", 9, "fallback")}, FALLBACK_REPORT_S - 1) == []
    grown = SeatCount("east", 12, "fallback")
    assert seats.changes({EAST: grown}, FALLBACK_REPORT_S) == [grown.line(EAST)]
    assert seats.changes({EAST: SeatCount("east", 13, "fallback")}, FALLBACK_REPORT_S + 1) == []


def test_poll_reads_at_most_every_few_seconds_and_is_quiet_when_the_service_is_not() -> None:
    seats, clock = watch({EAST: SeatCount("east", 4, "fallback")})
    reads: list[float] = []
    answers: list[dict[str, SeatCount] | None] = [None, {EAST: SeatCount("east", 8, "learned")}]

    def read(timeout: float = 1.0) -> dict[str, SeatCount] | None:
        reads.append(clock.now)
        return answers.pop(0)

    seats.read = read  # type: ignore[method-assign]
    seats._polled_at = 0.0
    clock.now = 1.0
    assert seats.poll() == [] and reads == []  # too soon
    clock.now = 2.0
    assert seats.poll() == []  # the service did not answer: nothing printed, nothing lost
    clock.now = 4.0
    assert seats.poll() == ["backend east 127.0.0.1:8101: seats 8 (learned from the engine)"]
    assert reads == [2.0, 4.0]


def test_the_banner_shows_the_services_seats_or_what_was_declared() -> None:
    spec = BackendSpec("127.0.0.1", 8101, "east")
    assert _backend_line(spec, {EAST: SeatCount("east", 4, "fallback")}) == (
        "backend east 127.0.0.1:8101: seats 4 (fallback: not learned yet)"
    )
    # the service did not answer in time
    assert _backend_line(spec, {}) == "backend east 127.0.0.1:8101: seats learned from the engine"
    declared = BackendSpec("127.0.0.1", 8101, "east", seats=6)
    assert _backend_line(declared, {}) == "backend east 127.0.0.1:8101: seats 6 (declared)"


@pytest.mark.parametrize(
    "spec",
    [
        BackendSpec("127.0.0.1", 8101, "east"),
        BackendSpec("10.0.0.5", 8000, "us-west-2", seats=64),
        BackendSpec("::1", 8000, "v6", seats=1),
    ],
    ids=str,
)
def test_up_hands_the_service_its_backends_as_given(spec: BackendSpec) -> None:
    assert parse_backend(backend_argument(spec)) == spec


def test_a_bad_seat_count_stops_the_command_before_anything_starts() -> None:
    with pytest.raises(SystemExit, match=r"fairlane: backend .*seats must be a whole number"):
        backends_from_args(["east=http://127.0.0.1:8101#seats=0"])
    with pytest.raises(SystemExit, match="unknown option 'slots=4'"):
        cli.main(["up", "--backend", "east=http://127.0.0.1:8101#slots=4"])


def test_the_help_shows_the_seat_syntax(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("up", "serve"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "--backend [REGION=]http://IP:PORT[#seats=N]" in text
        assert "#seats=N declares how many requests the engine runs at once" in text
