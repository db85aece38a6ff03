"""Where speculative decode steps spend their time: bench/spec_e2e.py with synchronized timers around the
runner's step launches and verify forwards and the MTP proposer's head passes (s24).

Each timed call is bracketed by device synchronizations, so the totals are slower than spec_e2e's own
figures; what it shows is which call takes how long, per shape: `launch_<rows>d_w<width>` (a step's forwards),
`verify_<B>x<width>`, `propose` (drafting, with any catch-up of the head over kept rows),
`observe_replay_<B>s` / `observe_verify_replay_<B>s` (the head's graphs) and
`observe_eager_<B>s_<rows>rows` (its eager forwards, where no graph fits). s24 found catch-ups of 256-416 rows
stalling 0.48-0.77 s this way (Triton kernels compiled or loaded mid-serving). Takes spec_e2e's arguments;
after its own lines prints one JSON line: {"kind": "phase_times", "ms": {name: {n, mean, max, first}}}.

    python bench/spec_phase_times.py --shape qwen3.6-27b --weights nvfp4 --with-mtp --draft-head 32768 \\
        --adaptive --concurrency 8 --acceptance 1.5 --max-tokens 256
    python bench/spec_phase_times.py --dry-run --adaptive --with-mtp --concurrency 2 --acceptance 1.5
"""

from __future__ import annotations

import atexit
import collections
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ninfer.engine.mtp_proposer import MTPProposer  # noqa: E402
from ninfer.engine.runner import ModelRunner  # noqa: E402

times: dict[str, list[float]] = collections.defaultdict(list)
sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)


def timed(cls, name: str, key=None) -> None:
    """Wrap cls.name: each call's milliseconds, between device synchronizations, under key(args) or name."""
    fn = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        sync()
        start = time.perf_counter()
        result = fn(self, *args, **kwargs)
        sync()
        times[key(self, *args, **kwargs) if key else name].append(round((time.perf_counter() - start) * 1e3, 3))
        return result

    setattr(cls, name, wrapper)


timed(ModelRunner, "launch",
      lambda self, plan: f"launch_{len(plan.decode)}d_w{max((len(w.tokens) for w in plan.decode), default=0)}")
timed(ModelRunner, "verify",
      lambda self, seqs, rows, width=None, drafts=None: f"verify_{len(seqs)}x{width or max(len(r) for r in rows)}")
timed(MTPProposer, "propose")
timed(MTPProposer, "_observe_replay", lambda self, seqs, *a: f"observe_replay_{len(seqs)}s")
timed(MTPProposer, "_observe_verify_replay", lambda self, seqs, *a: f"observe_verify_replay_{len(seqs)}s")
timed(MTPProposer, "_observe_eager",
      lambda self, seqs, starts, tokens, *a: f"observe_eager_{len(seqs)}s_{sum(len(t) for t in tokens)}rows")


@atexit.register
def report() -> None:
    ms = {k: {"n": len(v), "mean": round(sum(v) / len(v), 3), "max": max(v), "first": v[:3]}
          for k, v in sorted(times.items())}
    print(json.dumps({"kind": "phase_times", "ms": ms}), flush=True)


if __name__ == "__main__":
    from bench import spec_e2e

    spec_e2e.main()
