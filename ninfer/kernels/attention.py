"""Paged attention: write new K/V into the flat slot cache, then attend over each sequence's pages.

The torch reference loops over sequences with host lengths; it is the oracle that CUDA backends
are checked against. CUDA tensors take our Triton kernels (`triton_attention`: split-KV decode,
varlen causal prefill) unless NINFER_KERNELS=reference (see `ninfer.kernels.backend`).

Quantized KV (`--kv-dtype fp8|int8`; storage and scales in `ninfer.forward`): the models pass
a layer's scales with its values (`ModelCache.layer(i)`), and these functions switch on them. `write_kv` quantizes each new token per KV head (`quantize_kv`: scale = amax over head_dim /
448 for float8_e4m3fn, / 127 for symmetric int8; fp8 rounds to nearest even, int8 half away from
zero); the reference dequantizes the gathered slots (`dequantize_kv`) before SDPA; the Triton
kernels read the 1-byte values and fold the scales in. Per element the stored value is within
half a step of the input: |x - q*s| <= s/2 = amax/254 for int8; for fp8 <= 2^-4 |x|, and <= 2^-10 s
in e4m3's subnormal range (|x| < 2^-6 s). Unquantized caches take exactly the code they took before.

NVFP4 rows (`--kv-dtype nvfp4`, and V of `k8v4`; uint8 caches, layout in `ninfer.forward`):
`quantize_kv(x, torch.uint8)` takes the row scale s = amax / 2688 (448 * 6), u = x / s, per block of
16 the E4M3 block scale b = e4m3(amax(|u|) / 6) (round to nearest even, at most 448), and per element
the E2M1 code nearest to u / b (ties to the even code, saturating at 6; `ninfer.quant.nvfp4`'s
encoding). Dequantized: e2m1 * b * s. Per element the error is at most half a step of its block's
grid: |x - xq| <= h * b * s with h = 1/4 where |u / b| < 2, 1/2 below 4 and 1 above (at most
(1 + 2^-4) / 6 < 18 % of the block's amax: b rounds up by at most 2^-4); a block whose scale is an
E4M3 subnormal (block amax < 6 * 2^-6 s, 3.5e-5 of the row's amax) or 0 adds at most 6 * 2^-10 * s
(2.2e-6 of the row's amax).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.forward import NVFP4_BLOCK, NVFP4_ROW, ForwardBatch
from ninfer.kernels.backend import use_triton
from ninfer.quant.nvfp4 import E2M1_MAX, E4M3_MAX, _e2m1_codes, e2m1_table, pack_codes, unpack_codes

# largest stored magnitude per quantized dtype, in units of the fp32 scale (NVFP4: 448 * 6)
QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0, NVFP4_ROW: E4M3_MAX * E2M1_MAX}
_INV_QMAX = {dt: torch.tensor(1.0 / q, dtype=torch.float32).item() for dt, q in QMAX.items()}  # fp32(1/qmax)
_FP32_TINY = torch.finfo(torch.float32).tiny


def quantize_kv(x: torch.Tensor, storage: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (values [..., D] in `storage`, fp32 scales [...]) with x ~= values * scale; NVFP4
    (storage uint8): values are rows [..., D/2 + D/16] (`_quantize_nvfp4_rows`).
    The torch reference of `triton_attention.write_kv_quantized`."""
    qmax = QMAX[storage]
    xf = x.float()
    # amax * fp32(1/qmax) and an IEEE reciprocal: the same fp32 operations as the Triton write
    scale = (xf.abs().amax(-1) * _INV_QMAX[storage]).clamp_min(_FP32_TINY)
    if storage == NVFP4_ROW:
        return _quantize_nvfp4_rows(xf * torch.reciprocal(scale)[..., None]), scale
    y = (xf * torch.reciprocal(scale)[..., None]).clamp(-qmax, qmax)
    if storage == torch.int8:
        y = torch.where(y >= 0, y + 0.5, y - 0.5).trunc()
    return y.to(storage), scale


def _quantize_nvfp4_rows(u: torch.Tensor) -> torch.Tensor:
    """u [..., D] (x over its row scale: |u| <= 2688 up to rounding) -> NVFP4 rows [..., D/2 + D/16] uint8."""
    d = u.shape[-1]
    if d % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 KV needs head_dim % {NVFP4_BLOCK} == 0, not {d}")
    blocks = u.reshape(*u.shape[:-1], d // NVFP4_BLOCK, NVFP4_BLOCK)
    block_scale = (blocks.abs().amax(-1) / E2M1_MAX).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)  # RNE
    b = block_scale.float()
    # an all-zero block (or one below E4M3's smallest subnormal) has scale 0 and codes 0
    scaled = torch.where(b[..., None] > 0, blocks / b.clamp_min(_FP32_TINY)[..., None], torch.zeros_like(blocks))
    codes = pack_codes(_e2m1_codes(scaled).reshape(u.shape))
    return torch.cat([codes, block_scale.view(torch.uint8)], dim=-1)


def _dequantize_nvfp4_rows(rows: torch.Tensor) -> torch.Tensor:
    """NVFP4 rows [..., D/2 + D/16] uint8 -> e2m1 * block scale [..., D] fp32 (exact: before the row scale)."""
    d = rows.shape[-1] * 16 // 9
    codes, block_scale = rows[..., : d // 2], rows[..., d // 2:]
    values = e2m1_table(rows.device)[unpack_codes(codes).long()]
    blocks = values.reshape(*values.shape[:-1], d // NVFP4_BLOCK, NVFP4_BLOCK)
    return (blocks * block_scale.view(torch.float8_e4m3fn).float()[..., None]).reshape(values.shape)


def dequantize_kv(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored values (1-byte [..., D], or NVFP4 rows) and their fp32 scales [...] -> [..., D] in `dtype`."""
    if values.dtype == NVFP4_ROW:
        return (_dequantize_nvfp4_rows(values) * scale[..., None]).to(dtype)
    return (values.float() * scale[..., None]).to(dtype)


def _gather_dequantized(cache: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype):
    values = cache.view(torch.uint8)[slots].view(cache.dtype)  # gather bytes: not every device indexes float8
    return dequantize_kv(values, scale[slots], dtype)


def _check_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    if (k_scale is None) != (v_scale is None) or (k_scale is None and k_cache.dtype in QMAX):
        raise ValueError("a quantized KV cache needs both its scale tensors (see ModelCache.layer)")


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """k_cache/v_cache: [S, Hkv, D] (one layer); k/v: [T, Hkv, D]; slots: [T], -1 for padding (not
    written). With the layer's scales ([S, Hkv]: fp8/int8/NVFP4 caches) the new tokens are quantized."""
    _check_scales(k_cache, k_scale, v_scale)
    if k_scale is not None and use_triton(k):
        from ninfer.kernels import triton_attention

        triton_attention.write_kv_quantized(k_cache, v_cache, k_scale, v_scale, k, v, slots)  # masks padding
        return
    # below, torch ops (the fused Triton kernel writes an unquantized cache itself on CUDA): drop the
    # padding first (a host sync, never inside a CUDA graph: graphs need the Triton kernels)
    if slots.numel() and bool((slots < 0).any()):
        keep = slots >= 0
        k, v, slots = k[keep], v[keep], slots[keep]
    if k_scale is None:
        k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
        return
    for cache, scales, x in ((k_cache, k_scale, k), (v_cache, v_scale, v)):
        values, scale = quantize_kv(x, cache.dtype)
        cache.view(torch.uint8).index_copy_(0, slots, values.view(torch.uint8))  # no fp8 index_copy_ on CPU
        scales.index_copy_(0, slots, scale)


MAX_RUNS = 8  # past this many separate page runs a CPU decode row gathers its context into one copy


def cpu_decode_batch(batch: ForwardBatch, x: torch.Tensor) -> bool:
    """Whether a forward on `x`'s device is a CPU decode batch (one new token per sequence, no padding, no
    verification rows): what the models' CPU decode paths take. Decided once per forward."""
    if x.device.type != "cpu":
        return False
    decode = batch.derived.get("cpu_decode")
    if decode is None:
        decode = batch.derived["cpu_decode"] = batch.is_decode and batch.num_valid is None
    return decode


def _context_runs(batch: ForwardBatch, i: int, page_size: int) -> list[slice] | None:
    """Sequence i's context as slices of the flat cache, one per run of consecutive pages (a fresh request's
    pages mostly are one run: PagePool.allocate; a reused prefix adds one or two), or None past MAX_RUNS.
    The CPU reference then reads the cache in place instead of gathering the whole context per layer."""
    cached = batch.derived.setdefault("context_runs", {})  # the same for every layer of a forward
    if i not in cached:
        cached[i] = _page_runs(batch, i, page_size)
    return cached[i]


def _page_runs(batch: ForwardBatch, i: int, page_size: int) -> list[slice] | None:
    pages = batch.derived.get("host_pages")
    if pages is None:
        pages = batch.derived["host_pages"] = batch.page_table.tolist()  # CPU tensors only: no device sync
    n = batch.seq_lens_cpu[i]
    used = pages[i][: (n + page_size - 1) // page_size]
    runs, first = [], 0
    for j in range(1, len(used) + 1):
        if j == len(used) or used[j] != used[j - 1] + 1:
            lo = used[first] * page_size
            runs.append(slice(lo, lo + min(j * page_size, n) - first * page_size))
            first = j
            if len(runs) > MAX_RUNS:
                return None
    return runs


LONG_CONTEXT = 2560  # tokens: past this a CPU decode row takes the block-diagonal matmuls (_decode_row_long)
PV_SPLIT = 4  # a long run's probs @ values as this many batched pieces: oneDNN runs one long product on ~1 core


def _decode_row(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, runs: list[slice],
                scale: float) -> torch.Tensor:
    """One decode query [Hq, D] over a context held in runs of the flat cache [S, Hkv, D], on the CPU, without
    copying the context: torch's CPU flash-attention kernel over strided views of each run, the query heads
    of a KV head as that head's queries (no GQA expansion: each KV head is read once), and the runs'
    outputs merged by their log-sum-exps (fp32). Up to ~1k tokens 4-8x faster than per-head matmuls (small
    bf16 matmuls cost ~40 us each on the 2-core dev box); past LONG_CONTEXT `_decode_row_long`."""
    if sum(r.stop - r.start for r in runs) > LONG_CONTEXT:
        return _decode_row_long(q, k_cache, v_cache, runs, scale)
    kv_heads = k_cache.shape[1]
    qg = q.view(1, kv_heads, q.shape[0] // kv_heads, q.shape[-1]).to(k_cache.dtype)
    outs, lses = [], []
    for r in runs:
        k, v = k_cache[r].transpose(0, 1)[None], v_cache[r].transpose(0, 1)[None]  # [1, Hkv, n, D] views
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qg, k, v, scale=scale)
        outs.append(out)
        lses.append(lse)
    if len(runs) == 1:
        return outs[0].reshape(q.shape).to(q.dtype)
    weights = torch.softmax(torch.stack(lses), dim=0)  # [runs, 1, Hkv, group]: each run's share of the mass
    merged = (torch.stack(outs).float() * weights[..., None]).sum(0)
    return merged.reshape(q.shape).to(q.dtype)


_HEAD_MASKS: dict[tuple[int, torch.dtype], torch.Tensor] = {}


def _decode_row_long(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, runs: list[slice],
                     scale: float) -> torch.Tensor:
    """_decode_row over a long context, where the flash kernel is compute-bound (~2 GB/s a core at 6k tokens).
    A token's keys of all KV heads are one contiguous row [Hkv * D] of the cache, so a block-diagonal query
    (q of KV head h in columns h*D..(h+1)*D of its rows, zeros elsewhere) scores every head against the
    run's rows [n, Hkv * D] in one matmul with n as its long side, reading the keys once in place; one fp32
    softmax over all runs; probs @ the runs' value rows, whose diagonal blocks are the heads' outputs. The
    zeros cost 3x the multiply-adds of a per-head product, which memory bandwidth hides. 1.3-1.5x faster
    than the flash kernel at 3-6k tokens (SmolLM2, 2 cores)."""
    kv_heads, d = k_cache.shape[1], k_cache.shape[2]
    hq, width, dtype = q.shape[0], kv_heads * d, k_cache.dtype
    mask = _HEAD_MASKS.get((kv_heads, dtype))
    if mask is None:
        mask = _HEAD_MASKS[(kv_heads, dtype)] = torch.eye(kv_heads, dtype=dtype).view(kv_heads, 1, kv_heads, 1)
    q_block = (q.to(dtype).view(kv_heads, hq // kv_heads, 1, d) * mask).view(hq, width)
    scores = [F.linear(k_cache[r].view(-1, width), q_block) for r in runs]  # [n, Hq] each
    scores = (torch.cat(scores) if len(scores) > 1 else scores[0]).t()  # [Hq, context]
    probs = torch.softmax(scores.float() * scale, dim=-1).to(v_cache.dtype)
    acc, at = None, 0
    for r in runs:
        n = r.stop - r.start
        part = _probs_values(probs[:, at:at + n], v_cache[r].view(n, width))
        acc = part if acc is None else acc + part
        at += n
    # [Hq, Hkv * D] -> rows of KV head h keep columns h*D..(h+1)*D
    out = torch.diagonal(acc.view(kv_heads, hq // kv_heads, kv_heads, d), dim1=0, dim2=2)  # [group, D, Hkv]
    return out.permute(2, 0, 1).reshape(q.shape).to(q.dtype)


def _probs_values(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """probs [Hq, n] @ values [n, W]; a long n as PV_SPLIT batched pieces summed (and the remainder)."""
    n = values.shape[0]
    piece = n // PV_SPLIT
    if piece < 512:
        return probs @ values
    main = piece * PV_SPLIT
    parts = torch.bmm(probs[:, :main].view(-1, PV_SPLIT, piece).transpose(0, 1), values[:main].view(PV_SPLIT, piece, -1))
    out = parts.sum(0)
    return out + probs[:, main:] @ values[main:] if main < n else out


def cpu_decode_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                    page_size: int, scale: float) -> torch.Tensor:
    """paged_attention_ref for a CPU decode batch over an unquantized cache (cpu_decode_batch), without its
    per-call checks; q [B, Hq, D] may be a view. One row's output comes back without a copy."""
    if q.shape[0] == 1:
        return _cpu_decode_row(q[0], k_cache, v_cache, batch, 0, page_size, scale)[None]
    return paged_attention_ref(q, k_cache, v_cache, batch, page_size, scale)


def _cpu_decode_row(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, i: int,
                    page_size: int, scale: float) -> torch.Tensor:
    """Sequence i's decode row over its context in place, or, past MAX_RUNS runs of pages (a fragmented pool:
    retained prefixes hold pages between), over one gathered copy of it: at 6k tokens in 375 runs 2.3 ms a
    layer against 8.0 for SDPA over the gathered context with its KV heads expanded (2 cores)."""
    runs = _context_runs(batch, i, page_size)
    if runs is not None:
        return _decode_row(q, k_cache, v_cache, runs, scale)
    slots = sequence_slots(batch, i, page_size)
    return _decode_row(q, k_cache[slots], v_cache[slots], [slice(0, slots.numel())], scale)


def sequence_slots(batch: ForwardBatch, i: int, page_size: int) -> torch.Tensor:
    """Flat slot ids of sequence i's whole context (cached prefix and new tokens)."""
    n = batch.seq_lens_cpu[i]
    pages = batch.page_table[i, : (n + page_size - 1) // page_size].long()
    offsets = torch.arange(page_size, device=pages.device)
    return (pages[:, None] * page_size + offsets[None, :]).reshape(-1)[:n]


def paged_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, page_size: int,
    scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D]; caches: [S, Hkv, D]. Causal: new token j of a sequence sees positions <= its own.

    One fused SDPA call per sequence (GQA without repeating K/V); the explicit mask handles a
    chunk that starts after cached tokens, which SDPA's is_causal (top-left aligned) would not.
    """
    _check_scales(k_cache, k_scale, v_scale)
    out = torch.empty_like(q)
    start = 0
    for i, qlen in enumerate(batch.query_lens_cpu):
        n = batch.seq_lens_cpu[i]
        if qlen == 1 and k_scale is None and q.device.type == "cpu":
            out[start] = _cpu_decode_row(q[start], k_cache, v_cache, batch, i, page_size, scale)
            start += qlen
            continue
        slots = sequence_slots(batch, i, page_size)
        if k_scale is None:
            k = k_cache[slots].to(q.dtype).transpose(0, 1)[None]  # [1, Hkv, n, D]
            v = v_cache[slots].to(q.dtype).transpose(0, 1)[None]
        else:
            k = _gather_dequantized(k_cache, k_scale, slots, q.dtype).transpose(0, 1)[None]
            v = _gather_dequantized(v_cache, v_scale, slots, q.dtype).transpose(0, 1)[None]
        qi = q[start : start + qlen].transpose(0, 1)[None]  # [1, Hq, qlen, D]
        if qlen == 1:
            mask = None  # a decode token sees the whole context
        else:
            q_pos = torch.arange(n - qlen, n, device=q.device)[:, None]
            mask = torch.arange(n, device=q.device)[None, :] <= q_pos
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start : start + qlen] = o[0].transpose(0, 1)
        start += qlen
    return out


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, page_size: int,
    scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton kernels for CUDA tensors (decode: device lengths only, graph-capturable); else the reference.
    A verify batch (ForwardBatch.verify_width) runs as one decode row per token, each over its own context:
    row j of a sequence computes what a plain decode step at that position computes, with the same kernel."""
    if batch.verify_width:
        rows = batch.derived.get("decode_rows")
        if rows is None:  # built once per forward, not per layer
            rows = batch.derived["decode_rows"] = _verify_rows(batch)
        batch = rows
    if use_triton(q):
        from ninfer.kernels import triton_attention

        _check_scales(k_cache, k_scale, v_scale)
        if batch.is_decode:
            return triton_attention.paged_decode(q, k_cache, v_cache, batch.page_table, batch.seq_lens, page_size,
                                                 scale, k_scale=k_scale, v_scale=v_scale)
        return triton_attention.paged_prefill(q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens,
                                              batch.page_table, page_size, scale, max(batch.query_lens_cpu),
                                              k_scale=k_scale, v_scale=v_scale)
    return paged_attention_ref(q, k_cache, v_cache, batch, page_size, scale, k_scale, v_scale)


def _verify_rows(batch: ForwardBatch) -> ForwardBatch:
    """A verify batch seen as decode rows: one row per token, its page-table row repeated, the row's own
    context length (ForwardBatch.row_seq_lens)."""
    tokens = batch.row_seq_lens.shape[0]
    return ForwardBatch(
        input_ids=batch.input_ids, positions=batch.positions,
        query_start_loc=torch.arange(tokens + 1, dtype=torch.int32, device=batch.seq_lens.device),
        seq_lens=batch.row_seq_lens, page_table=batch.row_page_table(), slot_mapping=batch.slot_mapping,
        state_slots=batch.state_slots, query_lens_cpu=[1] * tokens,
        seq_lens_cpu=batch.row_seq_lens_cpu if batch.row_seq_lens_cpu is not None else batch.seq_lens_cpu,
    )
