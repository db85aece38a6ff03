"""Tensor moves the context cache and pausing need: page and state-slot copies on the device, and
snapshots of a request's KV pages and recurrent state to (pinned) host memory and back.

A quantized cache (fp8 / int8 / nvfp4 / k8v4) keeps one scale per (slot, KV head) in `k_scale` /
`v_scale`; every move of KV slots moves their scale rows with them, and the byte counts include them.
NVFP4 rows hold their E4M3 block scales after their codes (`ninfer.forward`), so moving a slot's row
moves its block scales too."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ninfer.forward import ModelCache


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Byte view of fp8 KV: every device supports indexing and copying uint8, not all float8."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _slot_index(cache: ModelCache, pages: list[int], device) -> torch.Tensor:
    page = torch.tensor(pages, dtype=torch.long, device=device)
    offsets = torch.arange(cache.page_size, device=device)
    return (page[:, None] * cache.page_size + offsets[None, :]).reshape(-1)


def copy_pages(cache: ModelCache, src: list[int], dst: list[int]) -> None:
    """Copy whole KV pages (copy-on-write of a shared tail page)."""
    if not src or cache.k.shape[0] == 0:
        return
    s, d = _slot_index(cache, src, cache.k.device), _slot_index(cache, dst, cache.k.device)
    for t in (_raw(cache.k), _raw(cache.v)):
        t[:, d] = t[:, s]
    if cache.k_scale is not None:
        cache.k_scale[:, d] = cache.k_scale[:, s]
        cache.v_scale[:, d] = cache.v_scale[:, s]


def copy_state(cache: ModelCache, src: int, dst: int) -> None:
    if cache.conv.shape[0] == 0:
        return
    cache.conv[:, dst] = cache.conv[:, src]
    cache.ssm[:, dst] = cache.ssm[:, src]


def page_bytes(cache: ModelCache) -> int:
    """KV bytes of one page over all layers, scales included."""
    return cache.kv_bytes_per_token * cache.page_size


def state_bytes(cache: ModelCache) -> int:
    if cache.conv.shape[0] == 0:
        return 0
    return (cache.conv[:, :1].numel() * cache.conv.element_size() + cache.ssm[:, :1].numel() * cache.ssm.element_size())


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class HostSnapshot:
    """A paused request's model state on the host: KV of its pages (in order) and its state slot."""

    k: torch.Tensor | None
    v: torch.Tensor | None
    conv: torch.Tensor | None
    ssm: torch.Tensor | None
    num_pages: int
    k_scale: torch.Tensor | None = None  # quantized KV only
    v_scale: torch.Tensor | None = None
    companions: list["HostSnapshot"] = field(default_factory=list)  # the same pages of companion caches

    @property
    def kv_nbytes(self) -> int:
        return _nbytes(self.k, self.v, self.k_scale, self.v_scale)

    @property
    def state_nbytes(self) -> int:
        return _nbytes(self.conv, self.ssm)

    @property
    def nbytes(self) -> int:
        return self.kv_nbytes + self.state_nbytes + sum(c.nbytes for c in self.companions)


def snapshot_bytes(cache: ModelCache, num_pages: int, has_state: bool, companions: tuple[ModelCache, ...] = ()) -> int:
    pages = num_pages * (page_bytes(cache) + sum(page_bytes(c) for c in companions))
    return pages + (state_bytes(cache) if has_state else 0)


def to_host(cache: ModelCache, pages: list[int], slot: int | None) -> HostSnapshot:
    pin = cache.k.device.type == "cuda"

    def host(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
        out.copy_(t, non_blocking=pin)
        return out

    k = v = k_scale = v_scale = conv = ssm = None
    if pages and cache.k.shape[0]:
        idx = _slot_index(cache, pages, cache.k.device)
        k, v = host(_raw(cache.k)[:, idx]), host(_raw(cache.v)[:, idx])  # fp8 travels as bytes
        if cache.k_scale is not None:
            k_scale, v_scale = host(cache.k_scale[:, idx]), host(cache.v_scale[:, idx])
    if slot is not None and cache.conv.shape[0]:
        conv, ssm = host(cache.conv[:, slot]), host(cache.ssm[:, slot])
    if pin:
        torch.cuda.current_stream(cache.k.device).synchronize()  # the host copy must be complete before pages are reused
    return HostSnapshot(k, v, conv, ssm, len(pages), k_scale, v_scale)


def from_host(cache: ModelCache, snap: HostSnapshot, pages: list[int], slot: int | None) -> None:
    if snap.k is not None:
        idx = _slot_index(cache, pages, cache.k.device)
        _raw(cache.k)[:, idx] = snap.k.to(cache.k.device, non_blocking=True)
        _raw(cache.v)[:, idx] = snap.v.to(cache.v.device, non_blocking=True)
        if snap.k_scale is not None:
            cache.k_scale[:, idx] = snap.k_scale.to(cache.k_scale.device, non_blocking=True)
            cache.v_scale[:, idx] = snap.v_scale.to(cache.v_scale.device, non_blocking=True)
    if snap.conv is not None and slot is not None:
        cache.conv[:, slot] = snap.conv.to(cache.conv.device, non_blocking=True)
        cache.ssm[:, slot] = snap.ssm.to(cache.ssm.device, non_blocking=True)
