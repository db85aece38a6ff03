"""The served CPU engine's decode thread count, chosen by timing its steps (ninfer.kernels.cpu_threads, issue 23)."""

from __future__ import annotations

import pytest

from ninfer.kernels.cpu_threads import ThreadChooser


def run_steps(chooser: ThreadChooser, cycle: dict[int, float], steps: int, context: int = 100, batch: int = 1,
              clock: list[float] | None = None) -> list[int]:
    """Decode `steps` steps back to back, each thread count's step taking cycle[threads] seconds; returns the
    counts picked. `clock` carries the time across calls."""
    clock = clock if clock is not None else [0.0]
    picked = []
    for _ in range(steps):
        threads = chooser.pick(context, batch)
        picked.append(threads)
        chooser.started(context, batch, threads, clock[0])
        clock[0] += cycle[threads] * 0.6  # the call
        chooser.ended(clock[0])
        clock[0] += cycle[threads] * 0.4  # the rest of the cycle: streaming, the other processes
    return picked


def test_tries_each_count_then_keeps_the_one_whose_steps_cycle_fastest():
    chooser = ThreadChooser((2, 1), trial=4, revisit=50)
    picked = run_steps(chooser, {1: 0.007, 2: 0.009}, 40)
    # the first try runs one step longer: a step is timed when the next one starts
    assert picked[:4] == [1] * 4 and 2 in picked[4:10]
    assert set(picked[12:]) == {1}
    assert chooser.snapshot() == {"band0_b1": 1}


def test_tries_the_others_again_and_follows_a_change_of_load():
    chooser = ThreadChooser((1, 2), trial=4, revisit=30)
    clock = [0.0]
    run_steps(chooser, {1: 0.007, 2: 0.009}, 40, clock=clock)
    assert chooser.snapshot() == {"band0_b1": 1}
    picked = run_steps(chooser, {1: 0.012, 2: 0.009}, 80, clock=clock)  # the other processes went quiet
    late = picked[-40:]  # after the first revisit: one thread only in its tries, every 30 steps
    assert late.count(2) > 2 * late.count(1)
    assert chooser.snapshot() == {"band0_b1": 2}


def test_each_context_band_and_batch_size_chooses_for_itself():
    chooser = ThreadChooser((1, 2), trial=3, revisit=1000)
    clock = [0.0]
    run_steps(chooser, {1: 0.007, 2: 0.009}, 20, context=300, clock=clock)
    run_steps(chooser, {1: 0.020, 2: 0.014}, 20, context=6000, clock=clock)
    run_steps(chooser, {1: 0.020, 2: 0.011}, 20, context=300, batch=4, clock=clock)
    assert chooser.snapshot() == {"band0_b1": 1, "band0_b4": 2, "band3_b1": 2}
    assert [ThreadChooser.band(n) for n in (0, 1023, 1024, 3000, 6000, 9000, 10**6)] == [0, 0, 1, 2, 3, 4, 5]


def test_a_step_after_an_idle_gap_or_a_prefill_is_not_timed():
    """A cycle counts only when the next decode step starts within max_gap of the call's end: otherwise the engine
    idled or prefilled in between, which says nothing about the thread count."""
    chooser = ThreadChooser((1, 2), trial=2, max_gap=0.02)
    chooser.started(100, 1, 1, 0.0)
    chooser.ended(0.004)
    chooser.started(100, 1, 1, 0.5)  # half a second later: not a cycle
    assert not chooser._choices or not any(chooser._choice((0, 1)).times.values())
    chooser.ended(0.504)
    chooser.started(100, 1, 1, 0.507)
    assert list(chooser._choice((0, 1)).times[1]) == [pytest.approx(0.007)]


def test_a_single_candidate_always_wins_and_an_empty_one_is_refused():
    chooser = ThreadChooser((1,), trial=2)
    assert set(run_steps(chooser, {1: 0.005}, 10)) == {1}
    assert chooser.snapshot() == {"band0_b1": 1}
    with pytest.raises(ValueError):
        ThreadChooser((0,))
