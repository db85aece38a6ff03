"""What one engine step runs, as plain data: the scheduler writes a StepPlan, the runner and the
context executor carry it out, and the scheduler reads the result back in `Scheduler.update`.

Nothing here holds tensors except media inputs handed through from the request. Positions and
page tables are read from each sequence when the runner builds the step's inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ninfer.engine.sequence import Sequence


@dataclass
class SeqWork:
    """One sequence's share of a step: `tokens` enter the cache at positions start.. (start is the
    sequence's computed frontier). A decode row is the last committed token followed by `draft_ids`
    (speculative proposals, empty without speculation); it asks for len(tokens) logit rows. A prefill
    chunk asks for one row, of its last token, and only when `sample` is set (the prompt's last chunk)."""

    seq: Sequence
    start: int
    tokens: list[int]
    draft_ids: list[int] = field(default_factory=list)
    media: list = field(default_factory=list)  # media spans inside [start, start + len(tokens)) (vision)
    sample: bool = True
    decode: bool = False  # a decode/verify row (else a prefill or replay chunk)
    draft_budget: int = 0  # drafts this row may carry (its pages are reserved); the proposer fills draft_ids
    # drafts still on the device: (table [rows, k], this work's row). draft_ids holds placeholders until
    # the verify forward's read back fills them (speculative.stage_drafts, ModelRunner.collect)
    staged: tuple | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def logit_rows(self) -> int:
        """Logit rows this work reads: every position of a decode/verify row, the last of a chunk."""
        return len(self.tokens) if self.decode else int(self.sample)


@dataclass
class ContextOp:
    """A device or host copy the plan needs before (or after) its forwards.

    kind:
    - "copy": device to device: KV pages src_pages -> dst_pages and/or state slot src_slot -> dst_slot
      (a reused prefix's copy-on-write tail page and StateImage);
    - "capture": device to device, the request's state slot src_slot into a checkpoint's dst_slot;
    - "snapshot": a pausing sequence's pages and state slot to its host snapshot;
    - "restore": a paused sequence's host snapshot into its new pages and slot.
    """

    kind: str
    seq: Sequence | None = None
    src_pages: list[int] = field(default_factory=list)
    dst_pages: list[int] = field(default_factory=list)
    src_slot: int | None = None
    dst_slot: int | None = None


@dataclass
class Admission:
    """A request bound this step: `reused` prompt tokens came from a retained checkpoint; `route` is
    "snapshot" or "replay" for a paused request coming back, None for a first binding."""

    seq: Sequence
    reused: int = 0
    route: str | None = None


@dataclass
class StepPlan:
    admitted: list[Admission] = field(default_factory=list)
    before: list[ContextOp] = field(default_factory=list)  # run before the forwards, in order
    prefill: SeqWork | None = None  # one request prefills at a time
    decode: list[SeqWork] = field(default_factory=list)  # every decode-ready request, one traversal
    after: list[ContextOp] = field(default_factory=list)  # captures at checkpoint positions
    preempted: list[Sequence] = field(default_factory=list)
    starved: list[Sequence] = field(default_factory=list)  # the oldest could not get room: ends at the context
    want_hidden: bool = False  # RunnerOutput.hidden: the final hidden states of every logit row (drafters)
    want_prefill_hidden: bool = False  # RunnerOutput.prefill_hidden: every prefill token's (the MTP head)

    @property
    def works(self) -> list[SeqWork]:
        """Every SeqWork in the order RunnerOutput.sampled lists them: the prefill first."""
        return ([self.prefill] if self.prefill is not None else []) + self.decode

    @property
    def empty(self) -> bool:
        return not (self.admitted or self.before or self.prefill or self.decode or self.after or self.preempted
                    or self.starved)

    def drop(self, seq: Sequence) -> None:
        """Forget seq's work and pending copies (it was paused by a later decision of the same step)."""
        if self.prefill is not None and self.prefill.seq is seq:
            self.prefill = None
        self.decode = [w for w in self.decode if w.seq is not seq]
        self.after = [op for op in self.after if op.seq is not seq]


@dataclass
class RunnerOutput:
    """sampled[i]: the tokens drawn for plan.works[i] (one per logit row; [] where nothing was sampled).
    hidden (plan.want_hidden): hidden[i] the final hidden states [rows, H] of plan.works[i]'s logit rows
    (a prefill chunk: its last token's), on the device; else None. prefill_hidden (plan.want_prefill_hidden):
    the prefill chunk's final hidden states, every token's."""

    sampled: list[list[int]]
    hidden: list | None = None
    prefill_hidden: object | None = None  # [chunk tokens, H] on the device (plan.want_prefill_hidden)
