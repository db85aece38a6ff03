"""The engine's timed choices (ninfer.timed_choice): whether to queue verify rounds, per batch size (Engine), on the
same machinery as the CPU decode-thread count (tests/test_cpu_threads.py)."""

from __future__ import annotations

import pytest

from ninfer.timed_choice import TimedChoice


def _cycles(choice: TimedChoice, key, cost: dict, steps: int, clock: list[float]) -> list:
    """`steps` steps back to back, a step under candidate c cycling cost[c] seconds; returns the candidates chosen."""
    picked = []
    for _ in range(steps):
        c = choice.choose(key)
        picked.append(c)
        choice.begin(key, c, clock[0])
        clock[0] += cost[c]
        choice.end(clock[0])
    return picked


def test_queueing_is_tried_both_ways_in_order_then_the_faster_kept_per_batch_size():
    choice = TimedChoice((False, True), what="queued verify rounds", trial=3, revisit=100, max_gap=0.001)
    clock = [0.0]
    picked = _cycles(choice, 1, {False: 0.0097, True: 0.0091}, 20, clock)
    assert picked[:3] == [False] * 3 and True in picked[3:6]  # tried in the order given
    assert set(picked[8:]) == {True}
    _cycles(choice, 8, {False: 0.0110, True: 0.0112}, 20, clock)  # another batch size decides for itself
    assert choice.decided() == {1: True, 8: False}
    assert choice.medians()[1] == {False: pytest.approx(0.0097), True: pytest.approx(0.0091)}


def test_a_step_left_open_is_not_timed():
    """A step never ended (the engine: not a full-width verify round) leaves the next start timing nothing."""
    choice = TimedChoice((False, True), what="queued verify rounds", trial=2, max_gap=0.001)
    choice.begin(1, False, 0.0)
    choice.begin(1, False, 0.010)  # the first step was not ended
    choice.end(0.020)
    choice.begin(1, False, 0.0205)
    assert list(choice._choice(1).times[False]) == [pytest.approx(0.0105)]
    with pytest.raises(ValueError):
        TimedChoice((), what="nothing")
