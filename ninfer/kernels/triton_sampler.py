"""The batched sampler (ninfer.engine.sampler.sample) in two Triton kernels instead of ~60 small torch ops.

Same arithmetic as the torch sampler, step for step:
1. `_candidates_kernel`, one program per (row, vocabulary chunk): the penalised logits
   z = logit - presence * [count > 0] - frequency * count (counts read by the row's lane, no gather)
   and the chunk's CAND best of them. A candidate is one int64 key: z's bits made order-preserving
   in the high 32 bits, the complement of its token id in the low 32, so the largest key is the
   largest z and, among equal z, the lowest id (torch.argmax's first occurrence).
2. `_choose_kernel`, one program per row: the row's CAND best keys over all chunks, sorted; then on
   those candidates: temperature, top-k, softmax, min-p, top-p, the counter-based Gumbel noise and
   the choice; greedy rows (temperature <= 0) take the best candidate.

Why: at batch 1 the torch sampler's ~60 launches (penalties and top-k over the whole vocabulary,
then dozens of ops on [B, 20]) cost ~0.35 ms per step even replayed from a CUDA graph (35B-A3B on
the H200, bench/results/2026-11-30-h200-s6), about a tenth of the step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.pdl import pdl_enter, pdl_launch
from ninfer.kernels.triton_compat import fix_interpreter

fix_interpreter()  # TRITON_INTERPRET=1 only: see triton_compat

CAND = 32  # candidates kept per chunk and per row: TOP_K_CAP (20) rounded up to a power of two
CHUNK = 4096  # vocabulary entries per program of the first kernel
_NO_KEY = tl.constexpr(-(2**63))  # below every real key
_MASK32 = tl.constexpr(0xFFFFFFFF)


@triton.jit
def _key(z, ids):
    """fp32 z, int32 ids -> int64 keys ordered by (z, -id)."""
    bits = z.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed order of the ints = order of the floats
    return (ordered.to(tl.int64) << 32) | (_MASK32 - ids.to(tl.int64))


@triton.jit
def _unkey(keys):
    """int64 keys -> (fp32 z, int64 ids)."""
    ordered = (keys >> 32).to(tl.int32)
    bits = tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
    return bits.to(tl.float32, bitcast=True), _MASK32 - (keys & _MASK32)


@triton.jit
def _candidates_kernel(
    LOGITS, COUNTS, LANES, PRESENCE, FREQUENCY, KEYS,
    width, stride_logits, stride_counts,
    NCHUNK: tl.constexpr, CHUNK_SIZE: tl.constexpr, NCAND: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    ids = chunk * CHUNK_SIZE + tl.arange(0, CHUNK_SIZE)
    valid = ids < width
    lane = tl.load(LANES + row)
    x = tl.load(LOGITS + row.to(tl.int64) * stride_logits + ids, mask=valid, other=0.0).to(tl.float32)
    count = tl.load(COUNTS + lane * stride_counts + ids, mask=valid, other=0.0)
    present = tl.where(count > 0, 1.0, 0.0)
    z = (x - tl.load(PRESENCE + row) * present) - tl.load(FREQUENCY + row) * count
    keys = tl.where(valid, _key(z, ids), _NO_KEY)
    best = tl.topk(keys, NCAND)
    tl.store(KEYS + (row * NCHUNK + chunk) * NCAND + tl.arange(0, NCAND), best)


@triton.jit
def _hash32(x):
    """lowbias32 on uint32 lanes (products wrap mod 2^32), as ninfer.engine.sampler._hash32."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _choose_kernel(
    KEYS, TEMPERATURE, TOP_P, TOP_K, MIN_P, SEED, STEP, OUT,
    NKEYS: tl.constexpr, NKEYS_P2: tl.constexpr, NCAND: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, NKEYS_P2)
    keys = tl.load(KEYS + row * NKEYS + offs, mask=offs < NKEYS, other=_NO_KEY)
    best = tl.topk(keys, NCAND)  # sorted, best first
    z, ids = _unkey(best)
    ranks = tl.arange(0, NCAND)
    temperature = tl.load(TEMPERATURE + row)
    keep = (ranks < tl.load(TOP_K + row)) & (best != _NO_KEY)  # top_k 1..20; padding when width < 20
    scaled = tl.where(keep, z / tl.maximum(temperature, 1e-5), float("-inf"))  # (no NaN from padding keys)
    e = tl.exp(scaled - tl.max(scaled, axis=0))
    probs = e / tl.sum(e, axis=0)
    keep = keep & (probs >= tl.load(MIN_P + row) * tl.max(probs, axis=0))
    mass_before = tl.cumsum(probs, axis=0) - probs
    keep = keep & ((mass_before < tl.load(TOP_P + row)) | (ranks == 0))
    log_probs = tl.where(keep, tl.log(tl.maximum(probs, 1e-30)), float("-inf"))
    # noise keyed by (seed, output index, rank): ninfer.engine.sampler.counter_uniform
    seed = tl.load(SEED + row)
    lo = (seed & _MASK32).to(tl.uint32)
    hi = ((seed >> 32) & _MASK32).to(tl.uint32)
    step = (tl.load(STEP + row) & _MASK32).to(tl.uint32)
    base = _hash32(_hash32(lo ^ _hash32(hi + 0x9E3779B9)) + step)
    h = _hash32(base * 0x27D4EB2F + ranks.to(tl.uint32) + 1)
    u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23: exact, inside (0, 1)
    gumbel = -tl.log(-tl.log(u))
    choice = tl.argmax(log_probs + gumbel, axis=0)
    sampled = tl.sum(tl.where(ranks == choice, ids, 0), axis=0)
    greedy = tl.sum(tl.where(ranks == 0, ids, 0), axis=0)
    tl.store(OUT + row, tl.where(temperature <= 0, greedy, sampled))


def fused_sample(logits: torch.Tensor, batch, counts: torch.Tensor, lanes: torch.Tensor,
                 chunk: int = CHUNK) -> torch.Tensor:
    """logits [B, width], batch: a SamplingBatch, counts: the penalty-count table [lanes, >= width]
    float32, lanes [B] int64 -> token ids [B] int64. No host synchronization. chunk: a power of two
    >= CAND (smaller ones keep the CPU interpreter quick in tests)."""
    rows, width = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    nchunk = triton.cdiv(width, chunk)
    keys = torch.empty(rows, nchunk * CAND, dtype=torch.int64, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _candidates_kernel[(rows, nchunk)](
        logits, counts, lanes, batch.presence_penalty, batch.frequency_penalty, keys,
        width, logits.stride(0), counts.stride(0),
        NCHUNK=nchunk, CHUNK_SIZE=chunk, NCAND=CAND, num_warps=8, **pdl_launch(logits.device))
    _choose_kernel[(rows,)](
        keys, batch.temperature, batch.top_p, batch.top_k, batch.min_p, batch.seed, batch.step, out,
        NKEYS=nchunk * CAND, NKEYS_P2=triton.next_power_of_2(nchunk * CAND), NCAND=CAND, num_warps=4,
        **pdl_launch(logits.device))
    return out


def check_against_reference(device: torch.device, width: int = 10_000, chunk: int = CHUNK) -> str | None:
    """Run the fused sampler beside the torch sampler on one fixed batch on `device` (mixed greedy,
    sampled and penalised rows, a tie at the top of a greedy row); None when every token agrees, else
    why not. The runner calls this at start-up and keeps the torch sampler unless it passes."""
    from ninfer.engine.sampler import SamplingBatch, sample

    try:
        gen = torch.Generator(device="cpu").manual_seed(1234)
        rows = 6
        logits = torch.randn(rows, width, generator=gen) * 4
        logits[1, 17] = logits[1, width // 2] = logits[1].max() + 1  # greedy tie: the lower id wins, as argmax
        counts = torch.randint(0, 3, (rows + 2, width), generator=gen).float()
        lanes = torch.tensor([5, 0, 2, 7, 1, 3])

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        batch = SamplingBatch(
            temperature=column([0.7, 0.0, 1.0, 1.3, 0.0, 0.6], torch.float32),
            top_p=column([0.8, 1.0, 0.95, 0.5, 1.0, 1.0], torch.float32),
            top_k=column([20, 20, 5, 20, 1, 12], torch.int64),
            min_p=column([0.0, 0.0, 0.05, 0.1, 0.0, 0.0], torch.float32),
            presence_penalty=column([1.5, 0.0, 0.0, 0.5, 1.0, 0.0], torch.float32),
            frequency_penalty=column([0.0, 0.0, 0.2, 0.1, 0.0, 0.0], torch.float32),
            seed=column([1, 2, -3, 2**62, 5, -(2**40)], torch.int64),
            step=column([0, 7, 100, 3, 0, 2**33], torch.int64),
        )
        logits, counts, lanes = logits.to(device), counts.to(device), lanes.to(device)
        got = fused_sample(logits, batch, counts, lanes, chunk=chunk).tolist()
        want = sample(logits, batch, counts[lanes]).tolist()
    except Exception as exc:  # a Triton build that cannot compile it: the torch sampler runs
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if got != want:
        return f"tokens differ from the torch sampler ({got} vs {want})"
    return None
