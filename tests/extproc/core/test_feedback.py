"""Completion feedback: response size -> output tokens, and settling a finished request."""

from extproc.core.admission import Admission
from extproc.core.events import Completion
from extproc.core.feedback import estimate_output_tokens, settle
from extproc.fleet.backend import COOL_OFF_S, FAILURES_TO_COOL_OFF
from tests.extproc.factories import API, Request, make_admission, scraped


def test_streamed_responses_are_about_224_bytes_a_token() -> None:
    # measured on the simulator's vLLM-shaped SSE: 50 tokens 11,592 bytes, 400 tokens 90,296
    assert abs(estimate_output_tokens(11_592, stream=True, max_tokens=None) - 50) <= 2
    assert abs(estimate_output_tokens(90_296, stream=True, max_tokens=None) - 400) <= 5


def test_non_streamed_responses_are_an_envelope_plus_about_5_bytes_a_token() -> None:
    assert abs(estimate_output_tokens(688 + 4.875 * 400, stream=False, max_tokens=None) - 400) <= 5  # type: ignore[arg-type]
    assert estimate_output_tokens(300, stream=False, max_tokens=None) == 0


def test_estimate_never_exceeds_max_tokens() -> None:
    assert estimate_output_tokens(10**7, stream=True, max_tokens=64) == 64


def _settle(admission: Admission, completion: Completion) -> int | None:
    """The output tokens ``completion`` settled (None: it was not in flight)."""
    settled = settle(admission, admission.pool, completion)
    return None if settled is None else settled.output_tokens


def test_settle_releases_the_slot_and_ignores_unknown_ids() -> None:
    admission, pool, _ = make_admission(limit=1)
    admission.submit("r1", Request(API, stream=True))  # type: ignore[arg-type]
    assert pool.backends[0].in_flight == 1
    assert _settle(admission, Completion("r1", 200, "127.0.0.1:9000", 1.0, 11_592)) == 50
    assert pool.backends[0].in_flight == 0
    assert _settle(admission, Completion("r1", 200, "", 1.0, 0)) is None  # already settled
    admission.submit("r2", Request(API))  # type: ignore[arg-type]
    assert _settle(admission, Completion("r2", 503, "127.0.0.1:9000", 0.1, 0)) == 0  # failed
    assert admission.in_flight == 0


def test_failing_completions_cool_the_answering_backend_off() -> None:
    admission, pool, clock = make_admission(limit=4, backends=2)
    first, second = pool.backends
    for i in range(FAILURES_TO_COOL_OFF):
        admission.submit(f"f{i}", Request(API))  # type: ignore[arg-type]
        # The upstream Envoy names is blamed, whichever backend was asked first.
        settle(admission, admission.pool, Completion(f"f{i}", 503, second.address, 0.1, 0))
    assert first.healthy and not second.healthy
    admission.submit("busy", Request(API))  # type: ignore[arg-type]
    admission.submit("next", Request(API))  # type: ignore[arg-type]
    assert admission.backend_of("next") is first  # the idle second is cooling off
    clock.now += COOL_OFF_S + 0.1
    assert second.healthy
    for backend in pool.backends:
        scraped(backend, clock)  # fresh metrics after the wait, or no gate passes
    admission.submit("later", Request(API))
    assert admission.backend_of("later") is second


def test_client_hang_ups_mid_response_and_4xx_are_not_backend_failures() -> None:
    admission, pool, _ = make_admission(limit=4)
    backend = pool.backends[0]
    for i in range(2 * FAILURES_TO_COOL_OFF):
        admission.submit(f"r{i}", Request(API))  # type: ignore[arg-type]
        status, sent = (0, 5_000) if i % 2 else (400, 120)
        settle(admission, admission.pool, Completion(f"r{i}", status, backend.address, 0.1, sent))
    assert backend.healthy and backend.failures == 0
    for i in range(FAILURES_TO_COOL_OFF):  # nothing came back at all: a dead connection
        admission.submit(f"d{i}", Request(API))  # type: ignore[arg-type]
        settle(
            admission, admission.pool, Completion(f"d{i}", 0, "", 0.1, 0)
        )  # no upstream: the one asked
    assert not backend.healthy
