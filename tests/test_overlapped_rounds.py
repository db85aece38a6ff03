"""Overlapped speculative rounds (Engine._queue_next_round; issue 21's host time between rounds): with the MTP head
drafting ahead, the engine queues round n+1's verify on the device, from inputs derived there, before it reads round
n back. Contract (speculative backends preserve output; prefix reuse; "the Engine commits the exact accepted target
prefix"): nothing a client sees may change. Output equals decoding without drafts token for token, greedy and seeded;
a request that ends inside a queued round (a stop token, a stop string, max_tokens, a cancel) ends where it would
without drafts, and the context it leaves to the next turn is the one a fresh engine computes.

The tiny MTP head's own drafts are almost never accepted, so the oracle's drafts (the target's continuation, a share
corrupted) replace them: on the host for rounds the host plans (`propose`), on the device for queued rounds
(OracleProposer.patch_ahead), so queued rounds commit long accepted runs."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_no_leak, mixed_prompts, run_all, token_ids
from kernel_markers import needs_cuda, needs_interpreter

from ninfer.engine.engine import EngineSettings
from ninfer.engine.loader import load_engine
from ninfer.engine.speculative import OracleProposer
from ninfer.engine.types import EngineRequest, FinishReason, SamplingParams

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0, presence_penalty=0.0, frequency_penalty=0.0)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=0, min_p=0.0, presence_penalty=0.0,
                        frequency_penalty=0.0)


def _requests(prefix: str, max_tokens: int, sampling=GREEDY, stop=None, n: int = 5) -> list[EngineRequest]:
    return [EngineRequest(f"{prefix}{i}", p, max_tokens=max_tokens, stop=list(stop or []),
                          sampling=sampling if sampling is GREEDY else SamplingParams(**{**vars(sampling), "seed": 11 + i}))
            for i, p in enumerate(mixed_prompts(n))]


def _plain(path, requests, device=CPU, **settings) -> list:
    """The requests' events from an engine without drafts that reuses nothing. Its KV capacity is the drafting
    engines' (_mtp_engine): on CUDA the decode attention's split count follows the cache's capacity
    (triton_attention.pick_num_splits), and with it the order of its sums."""
    engine = load_engine(path, EngineSettings(max_context=256, kv_capacity=1024, max_concurrency=1, prefill_chunk=16,
                                              prefix_reuse=False, **settings), device=device)
    try:
        return run_all(engine, requests)
    finally:
        engine.shutdown()


def _mtp_engine(path, oracle: OracleProposer, max_concurrency: int = 1, overlap: bool = True, device=CPU,
                **settings):
    """An MTP engine whose drafts are the oracle's, host and device side (module docstring)."""
    engine = load_engine(path, EngineSettings(max_context=256, kv_capacity=1024, max_concurrency=max_concurrency,
                                              prefill_chunk=16, draft_tokens=3, spec="mtp", overlap_rounds=overlap,
                                              **settings),
                         device=device)
    mtp = engine.proposer
    propose = mtp.propose

    def proposing(works, budgets):
        propose(works, budgets)
        oracle.propose(works, budgets)

    mtp.propose = proposing
    oracle.patch_ahead(mtp)
    return engine


@pytest.mark.parametrize("max_concurrency", [1, 3])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_queued_rounds_decode_as_without_drafts(tiny_qwen_mtp_path, max_concurrency, sampling, device=CPU):
    """Rounds queued before the read back commit exactly the tokens decoding without drafts gives, at one and at
    three rows a batch; the same run with queueing off agrees round for round."""
    requests = lambda: _requests("r", 40, sampling)  # noqa: E731
    # one request at a time on CUDA: a batch's size picks its kernels' configs, so a plain run's rounding matches a
    # speculative one's only at the same batch sizes (tests/test_speculative.py, the CUDA tests)
    base = _plain(tiny_qwen_mtp_path, requests(), device=device)
    oracle = OracleProposer({f"r{i}": token_ids(e) for i, e in enumerate(base)}, corrupt=0.25, vocab=900, seed=4)
    runs = {}
    for overlap in (True, False):
        engine = _mtp_engine(tiny_qwen_mtp_path, oracle, max_concurrency, overlap=overlap, device=device)
        try:
            events = run_all(engine, requests())
        finally:
            engine.shutdown()
        assert [token_ids(e) for e in events] == [token_ids(e) for e in base]
        assert [e[-1].reason for e in events] == [e[-1].reason for e in base]
        runs[overlap] = engine
        assert_no_leak(engine)
    queued, unqueued = runs[True], runs[False]
    # most rounds at one row; at three, prefill chunks share some steps and rows near their limits are not queued
    assert queued.queued_rounds > queued.counters.spec_rounds // (2 if max_concurrency == 1 else 5)
    assert unqueued.queued_rounds == 0 and queued.miscounted_rows == 0  # the device advanced rows as the host commits
    c = queued.counters
    assert c.spec_accepted_tokens > c.spec_rounds  # long accepted runs, in queued rounds too
    assert (c.spec_rounds, c.spec_accepted_tokens) == (unqueued.counters.spec_rounds,
                                                       unqueued.counters.spec_accepted_tokens)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_queued_rounds_decode_as_without_drafts_on_cuda(tiny_qwen_mtp_path, sampling):
    """The same on CUDA, one row a batch: verify, sampler and MTP head graphs replayed over rows derived on the
    device, the read back through pinned memory while the next round runs. (s39's first run of the seeded case
    failed, with queued rounds and without: the plain engine then had a 256-token KV cache, one attention split,
    against the drafting engine's 1024, two; `_plain` now gives it the same capacity.)"""
    test_queued_rounds_decode_as_without_drafts(tiny_qwen_mtp_path, 1, sampling, device=torch.device("cuda"))


def test_the_timed_choice_switches_queueing_mid_request_and_output_stays_exact(tiny_qwen_mtp_path):
    """Under the timed choice (overlap_rounds=None, the CUDA default) the engine alternates rounds without and with
    queueing (tries of two rounds here, tried again every three): every switch, a queued round followed by an
    unqueued one and the reverse, commits what decoding without drafts commits, and both ways get timed."""
    from ninfer.timed_choice import TimedChoice

    base = _plain(tiny_qwen_mtp_path, _requests("r", 40, n=3))
    oracle = OracleProposer({f"r{i}": token_ids(e) for i, e in enumerate(base)}, corrupt=0.25, vocab=900, seed=4)
    engine = _mtp_engine(tiny_qwen_mtp_path, oracle)
    engine.overlap_choice = TimedChoice((False, True), what="queued verify rounds", trial=2, revisit=3, max_gap=1.0)
    try:
        events = run_all(engine, _requests("r", 40, n=3))
    finally:
        engine.shutdown()
    assert [token_ids(e) for e in events] == [token_ids(e) for e in base]
    choice = engine.overlap_choice._choices[1]
    assert choice.decided and all(choice.times[on] for on in (False, True))
    assert 0 < engine.queued_rounds < engine.counters.spec_rounds  # some rounds queued, some not
    assert_no_leak(engine)


def test_queueing_is_timed_on_cuda_only_unless_a_setting_or_the_environment_fixes_it(monkeypatch):
    """overlap_rounds None (the default) times queueing both ways on CUDA and leaves it off on the CPU, where a forward
    runs as it is launched; True / False or NINFER_OVERLAP_ROUNDS=1 / 0 / auto decide otherwise; a drafter that does
    not draft ahead never queues."""
    from types import SimpleNamespace

    from ninfer.engine.engine import OVERLAP_ENV, Engine

    def setting(device: str, value, env=None, drafts_ahead=True):
        if env is None:
            monkeypatch.delenv(OVERLAP_ENV, raising=False)
        else:
            monkeypatch.setenv(OVERLAP_ENV, env)
        proposer = SimpleNamespace(ahead_drafts=None) if drafts_ahead else object()
        on, choice = Engine._overlap_setting(SimpleNamespace(proposer=proposer, device=torch.device(device)),
                                             EngineSettings(overlap_rounds=value))
        return on, choice is not None

    assert setting("cuda", None) == (True, True)
    assert setting("cpu", None) == (False, False)
    assert setting("cuda", False) == (False, False) and setting("cpu", True) == (True, False)
    assert setting("cuda", None, env="0") == (False, False) and setting("cuda", False, env="1") == (True, False)
    assert setting("cuda", False, env="auto") == (True, True) and setting("cpu", True, env="auto") == (False, False)
    assert setting("cuda", None, drafts_ahead=False) == (False, False)


def test_a_stop_token_inside_a_queued_round_leaves_a_context_the_next_turn_reuses_exactly(tiny_qwen_mtp_path):
    """Each request ends on a stop token inside an accepted run while the round after it is queued (the device
    cuts its commit at the stop token as the host does), so its recurrent state is the one at its end: the
    follow-up turn reuses the whole endpoint and decodes as an engine that reuses nothing."""
    prompts, ends = mixed_prompts(4), [5, 7, 9, 13]
    first = [token_ids(e) for e in _plain(tiny_qwen_mtp_path, _requests("a", 20, n=4))]
    outputs = [f[:n] for f, n in zip(first, ends)]
    assert all(o[-1] not in o[:-1] for o in outputs)  # the stop token ends each output where it stands
    follow = [p + o + [77, 78, 79] for p, o in zip(prompts, outputs)]
    expected = [token_ids(e) for e in _plain(tiny_qwen_mtp_path, [
        EngineRequest(f"b{i}", f, max_tokens=12, sampling=GREEDY) for i, f in enumerate(follow)])]
    oracle = OracleProposer({f"a{i}": f for i, f in enumerate(first)}, vocab=900)
    engine = _mtp_engine(tiny_qwen_mtp_path, oracle)
    try:
        for i, (prompt, output) in enumerate(zip(prompts, outputs)):
            engine.settings.eos_ids = {output[-1]}  # read as each request is prepared: this one's stop token
            before = engine.queued_rounds
            events = run_all(engine, [EngineRequest(f"a{i}", prompt, max_tokens=40, sampling=GREEDY)])[0]
            assert token_ids(events) == output and events[-1].reason is FinishReason.STOP
            assert engine.queued_rounds > before
            engine.settings.eos_ids = set()
            events = run_all(engine, [EngineRequest(f"b{i}", follow[i], max_tokens=12, sampling=GREEDY)])[0]
            assert events[-1].usage.cached_tokens == len(prompt) + len(output) - 1  # the endpoint, reused
            assert token_ids(events) == expected[i]
    finally:
        engine.shutdown()
    assert_no_leak(engine)


def test_stop_strings_and_limits_inside_queued_rounds_end_as_without_drafts(tiny_qwen_mtp_path, qwen_tokenizer):
    """A stop string or max_tokens that ends a request while its next round is queued ends it at the same token as
    without drafts; the follow-up turns (whatever they reuse) decode as an engine that reuses nothing."""
    base = _plain(tiny_qwen_mtp_path, _requests("r", 32))
    text = [qwen_tokenizer.decode(token_ids(e)) for e in base]
    stop = next(t[12:15] for t in text if len(t) >= 15 and t[12:15].strip())
    oracle = OracleProposer({f"r{i}": token_ids(e) for i, e in enumerate(base)}, vocab=900)
    engine = _mtp_engine(tiny_qwen_mtp_path, oracle, max_concurrency=3)
    try:
        for requests in (_requests("r", 32, stop=[stop]), _requests("r", 11)):
            want = _plain(tiny_qwen_mtp_path, requests)
            got = run_all(engine, requests)
            assert [token_ids(e) for e in got] == [token_ids(e) for e in want]
            assert [(e[-1].reason, e[-1].stop_string) for e in got] == [(e[-1].reason, e[-1].stop_string) for e in want]
        follow = [EngineRequest(f"f{i}", p + token_ids(e) + [77, 78], max_tokens=8, sampling=GREEDY)
                  for i, (p, e) in enumerate(zip(mixed_prompts(5), got))]
        assert [token_ids(e) for e in run_all(engine, follow)] == [token_ids(e) for e in _plain(tiny_qwen_mtp_path, follow)]
        assert engine.queued_rounds > 0
    finally:
        engine.shutdown()
    assert_no_leak(engine)


def test_a_request_cancelled_while_its_round_is_queued_leaves_the_others_exact(tiny_qwen_mtp_path):
    """A cancel that arrives while a round is queued ends that request; the others in the batch decode as
    without drafts and nothing leaks."""
    requests = _requests("r", 40, n=3)
    base = _plain(tiny_qwen_mtp_path, requests)
    oracle = OracleProposer({f"r{i}": token_ids(e) for i, e in enumerate(base)}, corrupt=0.2, vocab=900, seed=2)
    engine = _mtp_engine(tiny_qwen_mtp_path, oracle, max_concurrency=3)
    queue = engine._queue_next_round

    def cancelling(plan, launched):
        queued = queue(plan, launched)
        if queued is not None and any(w.seq.request_id == "r1" for w in queued[0].decode):
            engine.cancel("r1")  # read at the next loop boundary, with this round in flight
        return queued

    engine._queue_next_round = cancelling
    try:
        events = run_all(engine, requests)
    finally:
        engine.shutdown()
    assert events[1][-1].reason is FinishReason.CANCELLED
    assert [token_ids(events[i]) for i in (0, 2)] == [token_ids(base[i]) for i in (0, 2)]
    assert engine.dropped_rows > 0
    assert_no_leak(engine)


def test_a_row_whose_commit_falls_short_of_its_queued_round_is_rebuilt_by_replay(tiny_qwen_mtp_path):
    """The engine's safety net (Engine._adopt_queued): a request that goes on after committing less than the device
    assumed when it queued the next round (never expected: _may_queue keeps rows near a thinking budget's end out,
    whose closing suffix replaces the samples) has lost the state that round overwrote, so it is paused and rebuilt
    by replay. With the budget check taken out of _may_queue the case happens; output still equals decoding without
    drafts, token for token."""
    def requests():
        return [EngineRequest(f"t{i}", p, max_tokens=60, sampling=GREEDY, thinking=True, thinking_budget=budget)
                for i, (p, budget) in enumerate(zip(mixed_prompts(3), (9, 14, 21)))]

    base = _plain(tiny_qwen_mtp_path, requests())
    assert all(e[-1].thinking_budget_applied for e in base)
    oracle = OracleProposer({f"t{i}": token_ids(e) for i, e in enumerate(base)}, vocab=900)
    engine = _mtp_engine(tiny_qwen_mtp_path, oracle)
    may_queue = engine._may_queue

    def ignoring_budgets(seq, tokens):
        control = seq.controller
        budget, control.budget = control.budget, None
        try:
            return may_queue(seq, tokens)
        finally:
            control.budget = budget

    engine._may_queue = ignoring_budgets
    try:
        events = run_all(engine, requests())
    finally:
        engine.shutdown()
    assert [token_ids(e) for e in events] == [token_ids(e) for e in base]
    assert all(e[-1].thinking_budget_applied for e in events)
    assert engine.dropped_rows > 0 and any(e[-1].preemptions > 0 for e in events)  # rebuilt by replay
    assert_no_leak(engine)


def test_a_device_that_advanced_a_row_otherwise_than_the_host_commits_costs_a_replay_not_a_token(
        tiny_qwen_mtp_path, monkeypatch, caplog):
    """The engine checks the counts the device advanced each queued row by (read back with the queued round) against
    its own commit before it adopts the round. A device that counted otherwise (simulated: every fourth advance cuts
    each row after its first token, as if that were a stop token) has the row rebuilt by replay: output still equals
    decoding without drafts, and the log says what happened."""
    from ninfer.engine import next_round

    base = _plain(tiny_qwen_mtp_path, _requests("r", 40, n=3))
    oracle = OracleProposer({f"r{i}": token_ids(e) for i, e in enumerate(base)}, corrupt=0.25, vocab=900, seed=4)
    advance, calls = next_round.advance_rows, []

    def miscounting(rows, b, w, samples, drafts, stop_ids, page_size):
        calls.append(b)
        if len(calls) % 4 == 0:
            stop_ids = samples.view(b, w)[:, :1].to(stop_ids.dtype)
        return advance(rows, b, w, samples, drafts, stop_ids, page_size)

    monkeypatch.setattr(next_round, "advance_rows", miscounting)
    engine = _mtp_engine(tiny_qwen_mtp_path, oracle)
    try:
        events = run_all(engine, _requests("r", 40, n=3))
    finally:
        engine.shutdown()
    assert [token_ids(e) for e in events] == [token_ids(e) for e in base]
    assert len(calls) >= 4 and engine.miscounted_rows > 0 and engine.dropped_rows > 0
    assert any(e[-1].preemptions > 0 for e in events)
    assert "the device advanced its queued round" in caplog.text
    assert_no_leak(engine)


def test_a_fused_advance_that_fails_falls_back_to_the_torch_ops(monkeypatch, caplog):
    """next_round.advance_rows on a device where the fused kernel raises (a compile or launch failure; s40: it has not
    run on a GPU yet) logs it once and advances with the torch ops, the same rows, from then on."""
    pytest.importorskip("triton")
    from ninfer.engine import next_round
    from ninfer.engine.graphs import VerifyInputs
    from ninfer.kernels import triton_next_round

    def broken(*args):
        raise RuntimeError("no kernel here")

    rows, want = VerifyInputs(2, 4, 4, CPU), VerifyInputs(2, 4, 4, CPU)
    samples, drafts, stops = torch.arange(8), torch.full((2, 3), 7), torch.full((2, 1), -1)
    expected = next_round.advance_rows(want, 2, 4, samples, drafts, stops, 4)
    monkeypatch.setattr(next_round, "_fused_failed", False)
    monkeypatch.setattr(next_round, "use_triton", lambda t: True)
    monkeypatch.setattr(triton_next_round, "advance_rows_fused", broken)
    assert next_round.advance_rows(rows, 2, 4, samples, drafts, stops, 4).tolist() == expected.tolist()
    assert torch.equal(rows.i64, want.i64) and torch.equal(rows.i32, want.i32)
    assert next_round._fused_failed and caplog.text.count("fused next-round advance failed") == 1
    next_round.advance_rows(rows, 2, 4, samples, drafts, stops, 4)
    assert caplog.text.count("fused next-round advance failed") == 1


@needs_interpreter
def test_the_start_up_warm_up_runs_the_fused_advance_over_the_verify_graph_rows(monkeypatch):
    """Engine start-up compiles the fused advance over the one-sequence verify graph's static rows (next_round.warm_up)
    so the first queued round does not wait for Triton; here through the interpreter, on rows of the graphs' shape."""
    from types import SimpleNamespace

    from ninfer.engine import next_round
    from ninfer.engine.graphs import VerifyInputs

    calls = []
    fused = next_round.advance_rows

    def counting(*args):
        calls.append(args[1:3])
        return fused(*args)

    monkeypatch.setattr(next_round, "_fused_failed", False)
    monkeypatch.setattr(next_round, "use_triton", lambda t: True)
    monkeypatch.setattr(next_round, "advance_rows", counting)
    rows = VerifyInputs(4, 4, 8, CPU)
    runner = SimpleNamespace(draft_tokens=3, page_size=16, graphs={(1, 4): SimpleNamespace(inputs=rows)})
    next_round.warm_up(runner, stops=2)
    assert calls == [(1, 4)] and not next_round._fused_failed
    next_round.warm_up(SimpleNamespace(draft_tokens=3, page_size=16, graphs={}), stops=2)  # no graphs (CPU): nothing
    assert len(calls) == 1


@needs_interpreter
def test_the_fused_advance_rewrites_the_rows_as_the_torch_one():
    """kernels.triton_next_round (CUDA's one launch) against next_round.advance_rows' torch path, under Triton's
    interpreter: every accepted count from 0 to the width, stop tokens before, at and after the accepted run, and
    rows without stop tokens; each buffer of the static rows and the committed counts equal."""
    from ninfer.engine.graphs import VerifyInputs
    from ninfer.engine.next_round import advance_rows
    from ninfer.kernels.triton_next_round import advance_rows_fused

    gen = torch.Generator().manual_seed(3)
    b, w, pages, page_size = 5, 4, 8, 4
    for stops_wide in (0, 1, 3):
        rows = VerifyInputs(b, w, pages, CPU)
        rows.i64.copy_(torch.randint(0, 50, rows.i64.shape, generator=gen))
        rows.i32.copy_(torch.randint(0, 9, rows.i32.shape, generator=gen, dtype=torch.int32))
        ids, pos, _, _, _, _ = rows._views64(rows.i64)
        pos[: b * w] = (torch.arange(b)[:, None] * 3 + torch.arange(w)[None, :]).reshape(-1)  # within the table
        samples = torch.randint(0, 50, (b, w), generator=gen)
        grid = ids[: b * w].view(b, w)
        for i in range(b):  # row i accepts min(i, w - 1) drafts
            grid[i, 1: 1 + min(i, w - 1)] = samples[i, : min(i, w - 1)]
        stop_ids = torch.randint(0, 50, (b, stops_wide), generator=gen)
        if stops_wide:
            stop_ids[1, 0] = samples[1, 0]  # a stop token inside the accepted run
            stop_ids[4, -1] = samples[4, w - 1]  # the bonus token is a stop token
        drafts = torch.randint(0, 50, (b, w - 1), generator=gen)
        fused = VerifyInputs(b, w, pages, CPU)
        fused.i64.copy_(rows.i64)
        fused.i32.copy_(rows.i32)
        want = advance_rows(rows, b, w, samples.reshape(-1), drafts, stop_ids, page_size)
        got = advance_rows_fused(fused, b, w, samples.reshape(-1), drafts, stop_ids, page_size)
        assert got.tolist() == want.tolist()
        assert torch.equal(fused.i64, rows.i64) and torch.equal(fused.i32, rows.i32)
