"""When drafting pays: each decode step's draft count from measured acceptance and measured step costs.

A verify step of width w = k + 1 costs more than a plain decode step (more rows through every matmul; on
NVFP4 weights a GEMV that is instruction-bound beyond one row), so drafts that are seldom accepted make
decoding slower than no speculation. The controller (EngineSettings.adaptive_drafts; the server turns it
on) keeps:

- per batch size B and width w, the engine's wall time of decode-only steps (an exponential moving
  average, the proposer's own work included; a shape's first step is not counted when it is far over
  its estimate (graph capture, first compiles), and later samples are capped at OUTLIER times it);
  until a plain step (w = 1) is measured the engine decodes plainly, a batch size without one borrows the
  nearest measured one's; a width not measured at B costs T(B, 1) times its measured ratio to the plain
  step at a batch size BORROW away where both ran (as a run's batch shrinks, each size would otherwise pay
  a losing verify step to learn it); farther off the kernels differ (at 8 rows of the 27B NVFP4 shape a
  width-4 step costs ~2.4 plain ones, at 1 row ~1.8), so the cheapest ratio measured at any batch size
  prices it, which lets it be tried where drafts could pay at that price, not wherever a guess says so
  (s18, C=8 at acceptance 1.5: with +10 % a token assumed, the filling batch tried widths 2-4 at sizes
  3-7, each a losing step); a width measured nowhere costs T(B, 1) * (1 + UNMEASURED_COST * (w - 1)),
  so it gets tried;
- per sequence, the chance p that a draft stands given that the drafts before it stood: accepted drafts
  over accepted drafts plus rejections, both decayed each round. A fresh sequence starts from the
  engine's recent rounds (all sequences', decayed per verified row; PRIOR before any), weighted as
  FRESH_WEIGHT rounds: with a drafter that is seldom right, every new request would otherwise spend its
  first rounds drafting on an optimistic guess (on the H200 at C=8 a k=3 round costs ~2.6 plain steps).
  Acceptance differs by request (code, prose), so a sequence the engine's estimate keeps from drafting
  is probed early, and its own rounds take over from there (s16: after a run of poorly drafted requests,
  a well drafted one never drafted): a batch of fresh rows alone (a single stream, an arriving cohort)
  at its first decode step; a fresh row beside known ones as soon as PROBE_BUDGET allows, without
  waiting out the known rows' back-off (the whole batch pays a probe: at C=8 probing each arrival at
  once cost ~5 %). When that first draft falls, it is probed once more (FRESH_PROBES): one unlucky draft
  would otherwise keep a drafter that is right 90 % of the time out for the whole back-off (s18 on the
  H200 at C=1: 2 rounds in 128 tokens at acceptance 3.5, 0.95x plain).

Each step it takes the k in 0..K that maximises the batch's expected committed tokens per second,
sum_s (1 + p_s + ... + p_s^k) / T(B, k + 1), where k > 0 must beat k = 0 by MIN_GAIN (step times are
noisy; a drafter that is seldom right should not win on noise). While k = 0 wins, a step still drafts
one token now and then (a probe), so the estimates follow a drafter whose acceptance comes back: the
first PROBE_EVERY plain steps after drafting paid, then twice as many plain steps after each probe
that did not bring drafting back, up to PROBE_MAX (a back-off per sequence, the batch probed at its
shortest: the drafter failing some requests says little about the next), and never sooner than keeps
the probes' extra time under PROBE_BUDGET of the plain steps' (a probe is a verify step: at 8 rows of
the 27B NVFP4 shape a width-2 step costs ~1.6 plain ones, so probing every 16 steps alone cost ~4 %).
A probe's step time is kept apart from the drafting widths' (per batch size): after plain steps it also
pays the drafter's catch-up over the rows it skipped (s18, C=1: ~16 ms against ~10 for a width-2 step
while drafting), which would otherwise price one-draft steps out.
Free samples (s24): a probe's first draft is the MTP head's frontier draft, which predicts the token the next
plain step samples. Where the head has caught up over a sequence's kept rows (every CAP plain steps) or observed a
drafted step's rows, and the next step is plain, the engine checks that draft against the step's token and reports
it (`sample`): the outcome a probe would have had, without its verify step (at C=8 on the H200 a width-2 step costs
15.5 ms against 9.7, a catch-up's graph ~1.2 ms). Such a sample resets the batch's probe streak, so with catch-ups
every CAP plain steps explicit probes would remain only where back-offs are shorter than that. So a sequence's
sample sets its back-off to PROBE_MAX, stood or fell: its samples keep coming, and standing ones raise p until
drafting pays; only sequences without samples yet (a fresh one, before its first catch-up) keep the batch probing
(s25, H100, C=8 at acceptance 1.5 over 512 steps: with a standing sample resetting the back-off to PROBE_EVERY as a
standing probe does, 12 probe steps, ~1.8 % of the time; keeping the back-off as it was, 6).

Output never depends on it: drafts only decide how many tokens a step may commit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TIME_EMA = 0.2  # weight of a new step time
DECAY = 0.8  # per round, on a sequence's accepted and rejected counts
PRIOR = (2.0, 0.5)  # the engine's (accepted, rejected) before any round: p = 0.8
ENGINE_DECAY = 0.95  # per verified row, on the engine-wide counts a fresh sequence starts from
FRESH_WEIGHT = 1.0  # rounds' weight of that start: one probe's outcome moves it far
UNMEASURED_COST = 0.1  # per extra token of width, relative to a plain step, until measured
PROBE_EVERY = 16  # plain steps before the first probe
PROBE_MAX = 512  # the most plain steps between two probes
OUTLIER = 2.0  # a step-time sample is capped at this multiple of the shape's expected cost
MIN_GAIN = 1.1  # drafts only where they promise this much more throughput than plain steps
PROBE_BUDGET = 0.02  # the most a probe's extra time may add to the plain steps before the next probe
FRESH_PROBES = 2  # probes of a new sequence at its first steps, while each one's draft fell
BORROW = 1  # batch sizes apart an unmeasured width may borrow a measured ratio from (kernels change with M)


@dataclass
class _Acceptance:
    accepted: float = PRIOR[0]
    rejected: float = PRIOR[1]
    probe_every: int = PROBE_EVERY  # a sequence's probe back-off
    rounds: int = 0  # its own verified rows
    fell: bool = False  # whether the last one ended in a rejection

    @property
    def p(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


class DraftController:
    def __init__(self, max_drafts: int):
        self.max_drafts = max_drafts
        self._times: dict[tuple[int, int], float] = {}  # (batch, width) -> seconds per step
        self._warm: set[tuple[int, int, bool]] = set()  # shapes (and probes) whose first step has run
        self._seqs: dict[str, _Acceptance] = {}
        self._engine = _Acceptance()  # every sequence's rounds: a fresh sequence's prior
        self._probed: dict[str, int] = {}  # fresh probes sent to a sequence (FRESH_PROBES)
        self._plain_streak = 0  # plain steps since the last probe or drafting step
        self._probe_times: dict[int, float] = {}  # batch -> seconds of a probe step (kept apart: docstring)
        self._probing = False  # the last decision was a one-draft probe: its step's time is a probe's
        self.samples = 0  # free samples taken (`sample`)

    # ---- what the engine reports -----------------------------------------------------------------
    def step_time(self, batch: int, width: int, seconds: float) -> None:
        """A decode step's wall time. A shape's first step that takes over OUTLIER times its estimate is not
        counted (a CUDA graph captured or kernels compiled on first use), and later samples count as at most
        OUTLIER times the estimate (a pause): a width priced out by a one-off would not be chosen, so never
        measured again. A probe's step goes to the probe price of its batch size alike (docstring)."""
        probe, self._probing = self._probing and width == 2, False
        table, key = (self._probe_times, batch) if probe else (self._times, (batch, width))
        old = table.get(key)
        expected = old if old is not None else self.cost(batch, width)
        warm_key = (batch, width, probe)
        if expected is not None and seconds > OUTLIER * expected:
            if warm_key not in self._warm:
                self._warm.add(warm_key)
                return
            seconds = OUTLIER * expected
        self._warm.add(warm_key)
        table[key] = seconds if old is None else (1 - TIME_EMA) * old + TIME_EMA * seconds

    def round(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verified row: `accepted` of its `drafted` drafts stood (a shorter run ends in a rejection)."""
        rejected = 1.0 if accepted < drafted else 0.0
        a = self._seq(request_id)
        a.rounds += 1
        a.fell = accepted < drafted
        if accepted == drafted:  # every draft stood: whatever backed its probes off, probe it again soon
            a.probe_every = PROBE_EVERY
        a.accepted = DECAY * a.accepted + accepted
        a.rejected = DECAY * a.rejected + rejected
        e = self._engine
        e.accepted = ENGINE_DECAY * e.accepted + accepted
        e.rejected = ENGINE_DECAY * e.rejected + rejected

    def sample(self, request_id: str, stood: bool) -> None:
        """A draft the head gave before a plain step, checked against that step's token (the proposer's frontier
        draft, which a one-draft probe of the sequence would have verified): the probe's outcome without its
        verify step. Counted as a round; the sequence's probe back-off goes to PROBE_MAX whether the draft stood
        or fell (its samples keep coming more often than that; a drafter that recovers raises p sample by sample
        until drafting pays), and the batch's next probe waits a full gap again (docstring: Free samples)."""
        self.samples += 1
        self.round(request_id, 1, int(stood))
        self._seq(request_id).probe_every = PROBE_MAX
        self._plain_streak = 0

    def _seq(self, request_id: str) -> _Acceptance:
        a = self._seqs.get(request_id)
        if a is None:
            a = self._seqs[request_id] = self._fresh()
        return a

    def _fresh(self) -> _Acceptance:
        """A new sequence's counts: the engine's recent acceptance, weighted as FRESH_WEIGHT rounds."""
        p = self._engine.p
        return _Acceptance(p * FRESH_WEIGHT, (1 - p) * FRESH_WEIGHT)

    def forget(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)
        self._probed.pop(request_id, None)

    # ---- the decision --------------------------------------------------------------------------------
    def acceptance(self, request_id: str) -> float:
        a = self._seqs.get(request_id)
        return (a if a is not None else self._fresh()).p

    def cost(self, batch: int, width: int) -> float | None:
        """Seconds of a step of this shape: measured, or estimated from the plain step of this batch size (of
        the nearest measured one while it has none: decode costs change slowly with the batch) times the
        width's ratio to the plain step where both were measured, None when no plain step was measured yet."""
        if (batch, width) in self._times:
            return self._times[(batch, width)]
        plain = self._nearest(batch, 1)
        if plain is None:
            return None
        if width == 1:
            return plain[1]
        both = [b for b, w in self._times if w == width and (b, 1) in self._times]
        if not both:
            return plain[1] * (1 + UNMEASURED_COST * (width - 1))
        ratio = {b: self._times[(b, width)] / self._times[(b, 1)] for b in both}
        near = [b for b in both if abs(b - batch) <= BORROW]
        if near:
            return plain[1] * ratio[min(near, key=lambda b: (abs(b - batch), b))]
        return plain[1] * min(ratio.values())  # farther off: the cheapest ratio measured anywhere

    def _nearest(self, batch: int, width: int) -> tuple[int, float] | None:
        """(batch size, seconds) of the measured step of this width nearest in batch size."""
        got = [(abs(b - batch), b, t) for (b, w), t in self._times.items() if w == width]
        return None if not got else min(got)[1:]

    def _probe_gap(self, batch: int, request_ids: list[str], fresh: bool = False) -> int:
        """Plain steps before the next probe: the shortest back-off of the batch's sequences (none while a fresh one
        waits for its probe), and at least as many as keep a probe's extra time (its own price, else a width-2
        step's, over a plain step) within PROBE_BUDGET of theirs."""
        plain, probe = self.cost(batch, 1), self._probe_times.get(batch) or self.cost(batch, 2)
        extra = max(probe / plain - 1, 0.0) if plain and probe else 0.0
        every = 0 if fresh else min(self._seqs[r].probe_every if r in self._seqs else PROBE_EVERY
                                    for r in request_ids)
        return min(max(every, math.ceil(extra / PROBE_BUDGET)), PROBE_MAX)

    def drafts(self, batch: int, request_ids: list[str]) -> int:
        """The draft count for a decode step of `batch` rows whose drafting rows are `request_ids`."""
        k, self._probing = self._decide(batch, request_ids)
        return k

    def _fresh_probe_due(self, request_id: str) -> bool:
        """A new sequence's probe: none sent and no rounds of its own yet, or fewer than FRESH_PROBES rounds, each
        probe sent answered, and the last round's draft fell (whether a probe or drafted on the engine's estimate)."""
        sent = self._probed.get(request_id, 0)
        a = self._seqs.get(request_id)
        if a is None or a.rounds == 0:
            return sent == 0
        return sent < FRESH_PROBES and sent <= a.rounds < FRESH_PROBES and a.fell

    def _sent_fresh(self, request_ids: list[str]) -> None:
        self._plain_streak = 0
        for r in request_ids:
            self._probed[r] = self._probed.get(r, 0) + 1

    def _best(self, batch: int, ps: list[float]) -> int | None:
        """The k maximising expected committed tokens per second for drafting rows of acceptance ps (None
        while no plain step of this batch size was measured)."""
        plain = self.cost(batch, 1)
        if plain is None:  # no plain step of this size measured yet: take one, then compare with it
            return None
        best_k, best_rate = 0, None
        tokens, powers = float(batch), [1.0] * len(ps)  # tokens: sum_s (1 + p_s + ... + p_s^k), grown with k
        for k in range(self.max_drafts + 1):
            if k:
                powers = [q * p for q, p in zip(powers, ps)]
                tokens += sum(powers)
            # a verify step does a plain step's work and more: a measurement saying it is cheaper is noise (a plain
            # step timed during a pause), which would otherwise keep a drafter that is never right drafting, the
            # plain step never timed again (s24: CI, every draft wrong, 210 verify steps against 24 plain ones)
            cost = max(self.cost(batch, k + 1), plain)
            rate = tokens / cost
            if k > 0:  # drafting must beat plain decoding by MIN_GAIN: timing noise alone decides below it
                rate /= MIN_GAIN
            if best_rate is None or rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def _decide(self, batch: int, request_ids: list[str]) -> tuple[int, bool]:
        """(draft count, whether it is a one-draft probe)."""
        if not request_ids or self.max_drafts == 0:
            return 0, False
        best_k = self._best(batch, [self.acceptance(r) for r in request_ids])
        if best_k is None:
            return 0, False
        if best_k == 0:
            unseen = [r for r in request_ids if self._fresh_probe_due(r)]
            if unseen and len(unseen) == len(request_ids):  # a batch of fresh rows alone: probed at once
                self._sent_fresh(unseen)
                # as many drafts as would pay were they right as often as PRIOR says, so a probe that stands
                # commits a full round (s18, C=1: a width-2 probe that stood left p at ~0.44, short of the ~0.6
                # that 3 drafts need, for the whole back-off)
                hopeful = PRIOR[0] / sum(PRIOR)
                k = self._best(batch, [max(self.acceptance(r), hopeful) for r in request_ids]) or 1
                return k, k == 1
            self._plain_streak += 1
            # beside known rows a fresh one waits only for the probe budget, not a back-off: every verify row is
            # as wide as the widest, so the whole batch pays each probe (s18, C=8 at acceptance 1.5: arrivals a
            # step apart each probed the filling batch at once, 0.91-0.95x plain)
            if self._plain_streak >= self._probe_gap(batch, request_ids, fresh=bool(unseen)):
                self._plain_streak = 0  # unless the probe brings drafting back, each known row's next waits twice as long
                self._sent_fresh(unseen)
                for r in request_ids:
                    if r not in unseen:
                        a = self._seq(r)
                        a.probe_every = min(2 * a.probe_every, PROBE_MAX)
                return 1, True
            return 0, False
        self._plain_streak = 0
        for r in request_ids:
            if r in self._seqs:
                self._seqs[r].probe_every = PROBE_EVERY
        return best_k, False
