"""cache_control: which blocks become explicit shared-prefix write candidates.

Block-level markers take at most four slots. The request-level marker targets the last cacheable
block: it merges with a marker already there when the TTLs agree, conflicts when they differ, and
otherwise needs a free slot. TTLs are validated and carried as hints; residency follows the engine's
resource scheduler, not the clock.
"""

from __future__ import annotations

from collections.abc import Iterable

from ninfer.chat import ir
from ninfer.protocol.anthropic import CacheControl
from ninfer.protocol.errors import invalid

MAX_BREAKPOINTS = 4
DEFAULT_TTL = "5m"


def _ttl(control: CacheControl) -> str:
    return control.ttl or DEFAULT_TTL


def plan_cache_marks(blocks: Iterable[tuple[object, str]], last_cacheable: tuple[object, str] | None,
                     request_level: CacheControl | None) -> dict[int, ir.CacheMark]:
    """Marks keyed by id() of the wire block they belong to.

    `blocks` are every block that may carry cache_control, in prompt order, with their wire path;
    `last_cacheable` is the request-level marker's target.
    """
    marks: dict[int, ir.CacheMark] = {}
    where: dict[int, str] = {}
    for block, param in blocks:
        control: CacheControl | None = getattr(block, "cache_control", None)
        if control is None:
            continue
        if len(marks) == MAX_BREAKPOINTS:
            raise invalid(f"at most {MAX_BREAKPOINTS} blocks may carry cache_control; {param} would be the fifth",
                          f"{param}.cache_control", "too_many_cache_breakpoints")
        marks[id(block)] = ir.CacheMark(ttl=_ttl(control))
        where[id(block)] = param
    if request_level is None or last_cacheable is None:
        return marks
    target, param = last_cacheable
    ttl = _ttl(request_level)
    existing = marks.get(id(target))
    if existing is not None:
        if existing.ttl != ttl:
            raise invalid(f"the request-level cache_control (ttl {ttl}) targets {param}, which already carries "
                          f"cache_control with ttl {existing.ttl}", "cache_control", "conflicting_cache_control")
        return marks  # the same breakpoint, stated twice
    if len(marks) == MAX_BREAKPOINTS:
        raise invalid(f"the request-level cache_control needs a breakpoint slot for {param}, but {MAX_BREAKPOINTS} "
                      f"blocks already carry cache_control ({', '.join(where.values())})", "cache_control",
                      "too_many_cache_breakpoints")
    marks[id(target)] = ir.CacheMark(ttl=ttl)
    return marks
