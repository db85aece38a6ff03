"""Carries out a plan's context operations (ninfer.engine.plan.ContextOp): prefix and capture copies on
the device, pause snapshots to the host and restores from it. The KV manager decided them and keeps
the reference counts; this only moves bytes, in plan order, and counts them
(`Counters.context_transfer_bytes`, by resource and direction: d2d, d2h, h2d; `Counters.state_images` and
`tail_page_copies`), and with the request log on times each copy made for a request (RequestExposure.transferred).

Companion caches share the model cache's page numbering (a block drafter's context K/V: its entry for a
position lives at the position's slot), so their pages move with the model's: counted as "backend_kv".
"""

from __future__ import annotations

from ninfer.engine import transfers
from ninfer.engine.counters import Counters
from ninfer.engine.exposure import RESOURCES, StreamInterval
from ninfer.engine.kv_manager import KVManager
from ninfer.engine.plan import ContextOp
from ninfer.forward import ModelCache


class ContextExecutor:
    def __init__(self, kv: KVManager, model_cache: ModelCache, counters: Counters,
                 companions: tuple[ModelCache, ...] = ()):
        self.kv, self.model_cache, self.counters = kv, model_cache, counters
        self.companions = companions
        self.state_image_bytes = transfers.state_bytes(model_cache)

    def run(self, ops: list[ContextOp]) -> None:
        for op in ops:
            getattr(self, "_" + op.kind)(op)

    def _copy(self, op: ContextOp) -> None:
        interval = self._interval(op)
        moved = dict.fromkeys(RESOURCES, 0)
        if op.src_pages:
            transfers.copy_pages(self.model_cache, op.src_pages, op.dst_pages)
            moved["main_kv"] = len(op.dst_pages) * transfers.page_bytes(self.model_cache)
            self.counters.tail_page_copies += len(op.dst_pages)
            for cache in self.companions:
                transfers.copy_pages(cache, op.src_pages, op.dst_pages)
                moved["backend_kv"] += len(op.dst_pages) * transfers.page_bytes(cache)
        if op.src_slot is not None and op.dst_slot is not None:
            transfers.copy_state(self.model_cache, op.src_slot, op.dst_slot)
            moved["state"] = self.state_image_bytes
            images = self.counters.state_images
            images["captured" if op.kind == "capture" else "adopted"] += 1
        self._count("d2d", kv=moved["main_kv"], state=moved["state"], backend=moved["backend_kv"])
        if interval is not None:
            op.seq.exposure.transferred("d2d", interval.stop(), **moved)

    _capture = _copy  # a checkpoint's StateImage taken from the request's slot: the same copy, counted apart

    def _snapshot(self, op: ContextOp) -> None:
        seq, reserved = op.seq, op.seq.snapshot.nbytes
        interval = self._interval(op)
        snap = transfers.to_host(self.model_cache, op.src_pages, op.src_slot)
        snap.companions = [transfers.to_host(cache, op.src_pages, None) for cache in self.companions]
        seq.snapshot = snap
        self.kv.host_used += snap.nbytes - reserved
        c = self.counters
        c.transfer_bytes_d2h += snap.nbytes
        c.host_context_peak_bytes = max(c.host_context_peak_bytes, self.kv.host_used)
        self._count_snapshot("d2h", snap)
        if interval is not None:
            seq.exposure.transfer_bytes["d2h"] += snap.nbytes
            seq.exposure.transferred("d2h", interval.stop(), **_by_resource(snap))

    def _restore(self, op: ContextOp) -> None:
        seq = op.seq
        snap = seq.snapshot
        interval = self._interval(op)
        transfers.from_host(self.model_cache, snap, op.dst_pages, op.dst_slot)
        for cache, part in zip(self.companions, snap.companions):
            transfers.from_host(cache, part, op.dst_pages, None)
        self.kv.free_snapshot(seq)
        self.counters.transfer_bytes_h2d += snap.nbytes
        self._count_snapshot("h2d", snap)
        self.counters.snapshot_restores += 1
        if interval is not None:
            seq.exposure.snapshot_restores += 1
            seq.exposure.transfer_bytes["h2d"] += snap.nbytes
            seq.exposure.transferred("h2d", interval.stop(), **_by_resource(snap))

    def _count(self, direction: str, kv: int = 0, state: int = 0, backend: int = 0) -> None:
        moved = self.counters.context_transfer_bytes
        moved[f"main_kv_{direction}"] += kv
        moved[f"state_{direction}"] += state
        moved[f"backend_kv_{direction}"] += backend

    def _count_snapshot(self, direction: str, snap: transfers.HostSnapshot) -> None:
        moved = _by_resource(snap)
        self._count(direction, kv=moved["main_kv"], state=moved["state"], backend=moved["backend_kv"])
        if snap.state_nbytes:
            self.counters.state_images["to_host" if direction == "d2h" else "from_host"] += 1

    def _interval(self, op: ContextOp) -> StreamInterval | None:
        """The device interval of a copy made for a request whose exposure is kept (the request log is on)."""
        if op.seq is None or op.seq.exposure is None:
            return None
        return StreamInterval(self.model_cache.k.device)


def _by_resource(snap: transfers.HostSnapshot) -> dict[str, int]:
    return {"main_kv": snap.kv_nbytes, "state": snap.state_nbytes, "backend_kv": sum(c.nbytes for c in snap.companions)}
