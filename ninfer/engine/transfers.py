"""Tensor moves the context cache and pausing need: page and state-slot copies on the device, and
snapshots of a request's KV pages and recurrent state to (pinned) host memory and back."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer.models.batch import ModelCache


def _slot_index(cache: ModelCache, pages: list[int], device) -> torch.Tensor:
    page = torch.tensor(pages, dtype=torch.long, device=device)
    offsets = torch.arange(cache.page_size, device=device)
    return (page[:, None] * cache.page_size + offsets[None, :]).reshape(-1)


def copy_pages(cache: ModelCache, src: list[int], dst: list[int]) -> None:
    """Copy whole KV pages (copy-on-write of a shared tail page)."""
    if not src or cache.k.shape[0] == 0:
        return
    s, d = _slot_index(cache, src, cache.k.device), _slot_index(cache, dst, cache.k.device)
    cache.k[:, d] = cache.k[:, s]
    cache.v[:, d] = cache.v[:, s]


def copy_state(cache: ModelCache, src: int, dst: int) -> None:
    if cache.conv.shape[0] == 0:
        return
    cache.conv[:, dst] = cache.conv[:, src]
    cache.ssm[:, dst] = cache.ssm[:, src]


def page_bytes(cache: ModelCache) -> int:
    per_slot = cache.k[:, :1].numel() * cache.k.element_size() * 2
    return per_slot * cache.page_size


def state_bytes(cache: ModelCache) -> int:
    if cache.conv.shape[0] == 0:
        return 0
    return (cache.conv[:, :1].numel() * cache.conv.element_size() + cache.ssm[:, :1].numel() * cache.ssm.element_size())


@dataclass
class HostSnapshot:
    """A paused request's model state on the host: KV of its pages (in order) and its state slot."""

    k: torch.Tensor | None
    v: torch.Tensor | None
    conv: torch.Tensor | None
    ssm: torch.Tensor | None
    num_pages: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.conv, self.ssm) if t is not None)


def snapshot_bytes(cache: ModelCache, num_pages: int, has_state: bool) -> int:
    return num_pages * page_bytes(cache) + (state_bytes(cache) if has_state else 0)


def to_host(cache: ModelCache, pages: list[int], slot: int | None) -> HostSnapshot:
    pin = cache.k.device.type == "cuda"

    def host(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
        out.copy_(t, non_blocking=pin)
        return out

    k = v = conv = ssm = None
    if pages and cache.k.shape[0]:
        idx = _slot_index(cache, pages, cache.k.device)
        k, v = host(cache.k[:, idx]), host(cache.v[:, idx])
    if slot is not None and cache.conv.shape[0]:
        conv, ssm = host(cache.conv[:, slot]), host(cache.ssm[:, slot])
    if pin:
        torch.cuda.current_stream(cache.k.device).synchronize()  # the host copy must be complete before pages are reused
    return HostSnapshot(k, v, conv, ssm, len(pages))


def from_host(cache: ModelCache, snap: HostSnapshot, pages: list[int], slot: int | None) -> None:
    if snap.k is not None:
        idx = _slot_index(cache, pages, cache.k.device)
        cache.k[:, idx] = snap.k.to(cache.k.device, non_blocking=True)
        cache.v[:, idx] = snap.v.to(cache.v.device, non_blocking=True)
    if snap.conv is not None and slot is not None:
        cache.conv[:, slot] = snap.conv.to(cache.conv.device, non_blocking=True)
        cache.ssm[:, slot] = snap.ssm.to(cache.ssm.device, non_blocking=True)
