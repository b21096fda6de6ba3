"""The storage circuit breaker as a pure state machine, on a fake clock: no event loop, no sleeps."""

from __future__ import annotations

import logging

import pytest

from hicache.controller.storage.guarded import BreakerState, CircuitBreaker
from hicache.metrics import CollectorRegistry, default_cache_metrics, render


class FakeClock:
    """Monotonic seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_breaker(clock: FakeClock, **options: float) -> CircuitBreaker:
    settings: dict[str, float] = {"threshold": 3, "backoff_initial_s": 1.0, "backoff_max_s": 8.0, **options}
    return CircuitBreaker(
        "storage",
        threshold=int(settings["threshold"]),
        backoff_initial_s=settings["backoff_initial_s"],
        backoff_max_s=settings["backoff_max_s"],
        clock=clock,
    )


def fail_calls(breaker: CircuitBreaker, n: int) -> None:
    """`n` calls that each take a ticket and fail."""
    for _ in range(n):
        ticket = breaker.begin()
        assert ticket is not None
        breaker.failure(ticket)


def open_breaker(breaker: CircuitBreaker) -> None:
    fail_calls(breaker, breaker.threshold)
    assert breaker.state is BreakerState.OPEN


def test_opens_after_threshold_consecutive_errors_only() -> None:
    """Errors interleaved with successes never open it; `threshold` in a row do."""
    breaker = make_breaker(FakeClock())
    fail_calls(breaker, 2)
    ticket = breaker.begin()
    assert ticket is not None
    breaker.success(ticket)
    fail_calls(breaker, 2)
    assert breaker.state is BreakerState.CLOSED
    assert breaker.statistics().consecutive_failures == 2
    fail_calls(breaker, 1)
    assert breaker.state is BreakerState.OPEN
    assert breaker.statistics().opened == 1


def test_open_refuses_calls_until_the_backoff_has_passed() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock)
    open_breaker(breaker)
    clock.advance(0.999)
    assert not breaker.allows()
    assert breaker.begin() is None
    assert breaker.begin() is None
    stats = breaker.statistics()
    assert stats.refused == 2
    assert stats.next_probe_in_s == pytest.approx(0.001)
    clock.advance(0.001)
    assert breaker.allows()


def test_half_open_lets_exactly_one_probe_through() -> None:
    """While the probe is in flight every other call is refused, however much time passes."""
    clock = FakeClock()
    breaker = make_breaker(clock)
    open_breaker(breaker)
    clock.advance(1.0)
    probe = breaker.begin()
    assert probe is not None
    assert probe.probe
    assert breaker.state is BreakerState.HALF_OPEN
    clock.advance(100.0)
    assert not breaker.allows()
    assert breaker.begin() is None
    assert breaker.statistics().probes == 1


def test_a_successful_probe_closes_it_and_resets_the_backoff() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock)
    open_breaker(breaker)
    clock.advance(1.0)
    probe = breaker.begin()
    assert probe is not None
    breaker.failure(probe)  # backoff 2 s now
    clock.advance(2.0)
    probe = breaker.begin()
    assert probe is not None
    breaker.success(probe)
    assert breaker.state is BreakerState.CLOSED
    assert breaker.allows()
    stats = breaker.statistics()
    assert stats.consecutive_failures == 0
    assert stats.backoff_s == 1.0
    # Opening again starts from the initial backoff, not from where the last outage left it.
    open_breaker(breaker)
    clock.advance(1.0)
    assert breaker.allows()


def test_failed_probes_double_the_backoff_up_to_the_cap() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock, backoff_initial_s=1.0, backoff_max_s=5.0)
    open_breaker(breaker)
    waits = []
    for _ in range(5):
        wait = breaker.statistics().next_probe_in_s
        waits.append(wait)
        clock.advance(wait - 0.01)
        assert breaker.begin() is None, "no probe before the backoff has passed"
        clock.advance(0.01)
        probe = breaker.begin()
        assert probe is not None
        assert probe.probe
        breaker.failure(probe)
        assert breaker.state is BreakerState.OPEN
    assert waits == pytest.approx([1.0, 2.0, 4.0, 5.0, 5.0])


def test_a_cancelled_probe_counts_as_failed_and_a_cancelled_call_as_nothing() -> None:
    """A probe cancelled by its caller proved nothing: the breaker backs off again rather than letting
    the next request probe (and maybe hang) at once. A cancelled ordinary call changes nothing."""
    clock = FakeClock()
    breaker = make_breaker(clock)
    fail_calls(breaker, 2)
    ticket = breaker.begin()
    assert ticket is not None
    breaker.abandon(ticket)
    assert breaker.statistics().consecutive_failures == 2
    fail_calls(breaker, 1)
    clock.advance(1.0)
    probe = breaker.begin()
    assert probe is not None
    breaker.abandon(probe)
    assert breaker.state is BreakerState.OPEN
    assert breaker.statistics().backoff_s == 2.0


def test_late_answers_from_before_the_opening_are_ignored() -> None:
    """Calls started while closed may answer after the breaker opened: they neither close it nor
    count again; only the probe decides."""
    clock = FakeClock()
    breaker = make_breaker(clock)
    early = [breaker.begin() for _ in range(2)]
    open_breaker(breaker)
    assert early[0] is not None
    assert early[1] is not None
    breaker.success(early[0])
    assert breaker.state is BreakerState.OPEN
    clock.advance(1.0)
    probe = breaker.begin()
    assert probe is not None
    breaker.failure(early[1])
    assert breaker.state is BreakerState.HALF_OPEN
    breaker.success(probe)
    assert breaker.state is BreakerState.CLOSED


def test_a_failure_without_a_ticket_counts_like_a_call() -> None:
    """A timeout the caller saw (its own deadline cut the call) is a failure too."""
    breaker = make_breaker(FakeClock())
    for _ in range(3):
        breaker.failure()
    assert breaker.state is BreakerState.OPEN


def test_each_state_change_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """Many refused calls and late failures while open log nothing; opening and recovery log one
    warning each, the probe one info line."""
    caplog.set_level(logging.DEBUG, logger="hicache.breaker")
    clock = FakeClock()
    breaker = make_breaker(clock)
    fail_calls(breaker, 3)
    for _ in range(7):  # failures reported while open (timeouts seen by callers) change nothing
        breaker.failure()
    for _ in range(50):
        assert breaker.begin() is None
    clock.advance(1.0)
    probe = breaker.begin()
    assert probe is not None
    breaker.success(probe)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "unavailable" in warnings[0]
    assert "3 consecutive errors" in warnings[0]
    assert "recovered" in warnings[1]
    changes = [r.getMessage() for r in caplog.records]
    assert len(changes) == 3, changes  # open, half-open, closed


def test_the_cache_gauge_follows_the_state() -> None:
    """The gauge exports 0 closed, 1 open, 2 half-open through a listener, as the cache wires it."""
    clock = FakeClock()
    breaker = make_breaker(clock)
    registry = CollectorRegistry()
    state = default_cache_metrics(registry).storage_breaker_state
    gauge = state.labels(tier="storage")
    gauge.set(breaker.state)
    breaker.listeners.append(lambda old, new: gauge.set(new))
    seen = [state.value(tier="storage")]
    open_breaker(breaker)
    seen.append(state.value(tier="storage"))
    clock.advance(1.0)
    probe = breaker.begin()
    assert probe is not None
    seen.append(state.value(tier="storage"))
    breaker.success(probe)
    seen.append(state.value(tier="storage"))
    assert seen == [0.0, 1.0, 2.0, 0.0]
    assert 'hicache_storage_breaker_state{tier="storage"} 0.0' in render(registry)


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"threshold": 0}, "threshold"),
        ({"backoff_initial_s": 0.0}, "backoff_initial_s"),
        ({"backoff_initial_s": 2.0, "backoff_max_s": 1.0}, "backoff_max_s"),
    ],
)
def test_bad_settings_name_the_argument(options: dict[str, float], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        make_breaker(FakeClock(), **options)
