from extproc.backends import Backend, BackendSpec
from extproc.picker import pick


def fleet(*loads: tuple[str, int, bool]) -> list[Backend]:
    backends = []
    for i, (region, in_flight, healthy) in enumerate(loads):
        backend = Backend(BackendSpec("127.0.0.1", 9000 + i, region))
        backend.in_flight = in_flight
        backend.healthy = healthy
        backends.append(backend)
    return backends


def ports(chosen: list[Backend] | None) -> list[int]:
    assert chosen is not None
    return [b.spec.port for b in chosen]


def test_least_loaded_first_then_alternates_from_another_region_first() -> None:
    backends = fleet(("a", 3, True), ("a", 1, True), ("b", 5, True))
    assert ports(pick(backends, backends)) == [9001, 9002, 9000]


def test_unhealthy_backends_are_never_alternates() -> None:
    backends = fleet(("a", 0, False), ("b", 2, True), ("b", 1, True))
    assert ports(pick(backends[1:], backends)) == [9002, 9001]


def test_backends_that_may_not_take_it_can_be_alternates_but_not_first() -> None:
    backends = fleet(("a", 0, True), ("b", 2, True))
    assert ports(pick(backends[1:], backends)) == [9001, 9000]


def test_none_without_candidates() -> None:
    backends = fleet(("a", 4, True))
    assert pick([], backends) is None


def test_tie_goes_to_the_first_configured_region() -> None:
    backends = fleet(("local", 1, True), ("remote", 1, True))
    assert ports(pick(backends, backends))[0] == 9000
