"""Gated DeltaNet kernels over a ragged batch, with the recurrent state kept in caller-owned slots.

Two levels:
- `short_conv` / `gated_delta_rule` are what the model calls once per GDN layer. They gather each
  sequence's state from its slot (zero for a sequence with nothing cached, whatever the slot
  holds), run the op, and write the final state back to the slot.
- The ops below them keep the call shapes of the CUDA libraries (causal-conv1d, fla-core's
  `chunk_gated_delta_rule` / `fused_recurrent_gated_delta_rule`: varlen layout [1, T, H, D] with
  `cu_seqlens`, dense per-sequence states [N, ...] in and out), so a CUDA backend drops in at the
  one dispatch function per op without touching the model.

The torch references compute in fp32 and are the oracle the CUDA backends are checked against.
Math: qwen35-architecture.md section 3.

CUDA backends (`ninfer.kernels.backend` picks; NINFER_KERNELS=reference forces the references):
- decode (one token per sequence): our Triton kernels read and write the conv and recurrent
  states in their slots in place (`triton_gdn`), with device tensors only: graph-capturable;
- prefill chunks: the conv + SiLU in Triton, the chunked delta rule through fla-core
  (`fla_gdn`) when fla is importable, else the torch reference.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ninfer.forward import ForwardBatch
from ninfer.kernels.backend import use_fla, use_triton
from ninfer.kernels.linear import SplitSums

# a verify batch's GDN positions in one launch per layer (triton_gdn.conv1d_steps, recurrent_gated_delta_rule_steps),
# bit for bit the one-step kernels' results; NINFER_FUSED_VERIFY_STEPS=0 launches one kernel a position (A/B benchmarks)
FUSED_VERIFY_STEPS = os.environ.get("NINFER_FUSED_VERIFY_STEPS", "1") != "0"
# the decode and verify kernels compute the gates from the raw projections (triton_gdn's raw_gates), bit for bit the
# gates kernel's values, reducing a separate b/a projection's split-K partial sums themselves (the NVFP4 27B's bf16
# b/a: 96 launches a forward fewer in all); NINFER_FUSED_GDN_GATES=0 launches the reduction and gates first (A/B)
FUSED_GATES = os.environ.get("NINFER_FUSED_GDN_GATES", "1") != "0"
CHUNK_SIZE = 64  # chunk length of the chunked delta rule (the FLA kernels use 64 as well)


@dataclass
class GDNGates:
    """A GDN layer's gate inputs: its projections b, a [T, Hv] (column views of the fused projection are fine; on the
    decode path possibly the skinny GEMM's unreduced partial sums, linear.SplitSums) and its A_log, dt_bias [Hv].
    The Triton decode and verify kernels compute beta and g from them in their own programs (summing partial sums
    themselves); every other path takes `values()`."""

    b: torch.Tensor | SplitSums
    a: torch.Tensor | SplitSums
    a_log: torch.Tensor
    dt_bias: torch.Tensor

    def values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(beta [T, Hv] in b's dtype, g [T, Hv] fp32): fused.gdn_gates."""
        from ninfer.kernels import fused

        b, a = (t.total() if isinstance(t, SplitSums) else t for t in (self.b, self.a))
        return fused.gdn_gates(b, a, self.a_log, self.dt_bias)

    def kernel_args(self, dtype: torch.dtype) -> dict:
        """The Triton recurrent kernels' gate arguments for v of `dtype`: the raw projections (FUSED_GATES; partial
        sums as [S, T, Hv] views), else the values."""
        if not FUSED_GATES:
            beta, g = self.values()
            return dict(g=g, beta=beta)
        assert self.b.dtype == self.a.dtype == dtype
        b, a = (t.partials[..., t.start:t.start + t.size] if isinstance(t, SplitSums) else t for t in (self.b, self.a))
        return dict(g=a, beta=b, raw_gates=(self.a_log, self.dt_bias))


def takes_raw_gates(x: torch.Tensor, meta: GDNMetadata) -> bool:
    """Whether gated_delta_rule hands this batch's gate projections to a Triton kernel raw, which can then take them
    as unreduced partial sums (project's split_sums)."""
    triton_path = meta.is_decode or (meta.verify_steps is not None and FUSED_VERIFY_STEPS)
    return FUSED_GATES and triton_path and use_triton(x)


@dataclass
class GDNMetadata:
    """Per-batch facts every GDN layer needs; built once per forward, not per layer."""

    cu_seqlens: torch.Tensor  # [N+1] int32 token offsets of each sequence
    state_slots: torch.Tensor  # [N] int64 state slot of each sequence
    has_initial_state: torch.Tensor  # [N] bool: the sequence continues from cached tokens
    seq_idx: torch.Tensor  # [T] int64 sequence of each token
    pos_in_seq: torch.Tensor  # [T] int64 offset of each token among its sequence's new tokens
    query_lens_cpu: list[int]
    is_decode: bool  # every sequence advances one token: the recurrent (decode) kernels apply
    # prefill only (None for decode): fla's varlen bookkeeping, built once per forward on the device
    # so that its 48 GDN layers neither rebuild it nor upload it (each pageable upload stalls the host)
    cu_seqlens_long: torch.Tensor | None = None  # [N+1] int64, the one object every layer passes
    chunk_indices: torch.Tensor | None = None  # [num_chunks, 2] int64 (sequence, chunk within it)
    # a padded one-sequence prefill (ForwardBatch.num_valid): [T, 1] bool, the real tokens; padding
    # gets beta = 0 and g = 0 (the delta rule then leaves the state as it is) and the conv state is
    # taken at the last real token (state_cu_seqlens: [0, num_valid])
    valid: torch.Tensor | None = None
    state_cu_seqlens: torch.Tensor | None = None
    # a verify batch (ForwardBatch.verify_width): each sequence's tokens are stepped one position at a
    # time with the decode kernels; (state slot in, state slot out) of every position, [B] each
    verify_steps: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    verify_out_slots: torch.Tensor | None = None  # [width, B] int64: the slots out of verify_steps, for one launch

    @classmethod
    def from_batch(cls, batch: ForwardBatch) -> "GDNMetadata":
        qsl = batch.query_start_loc
        query_lens = (qsl[1:] - qsl[:-1]).long()
        num_tokens = batch.input_ids.shape[0] if batch.inputs_embeds is None else batch.inputs_embeds.shape[0]
        seqs = torch.arange(batch.num_seqs, device=qsl.device)
        # output_size keeps repeat_interleave from reading the lengths back to the host
        seq_idx = torch.repeat_interleave(seqs, query_lens, output_size=num_tokens)
        pos_in_seq = torch.arange(num_tokens, device=qsl.device) - qsl.long()[seq_idx]
        is_decode = batch.is_decode
        if batch.verify_width:
            steps = _verify_steps(batch)
            return cls(cu_seqlens=qsl.to(torch.int32), state_slots=batch.state_slots.long(),
                       has_initial_state=(batch.seq_lens.long() - query_lens) > 0, seq_idx=seq_idx,
                       pos_in_seq=pos_in_seq, query_lens_cpu=list(batch.query_lens_cpu), is_decode=False,
                       verify_steps=steps, verify_out_slots=torch.stack([out for _, out in steps]))
        valid = state_cu_seqlens = None
        if batch.num_valid is not None:
            valid = (torch.arange(num_tokens, device=qsl.device) < batch.num_valid)[:, None]
            state_cu_seqlens = torch.cat([qsl[:1].to(torch.int32), batch.num_valid.to(torch.int32)])
        return cls(
            cu_seqlens=qsl.to(torch.int32),
            state_slots=batch.state_slots.long(),
            has_initial_state=(batch.seq_lens.long() - query_lens) > 0,
            seq_idx=seq_idx,
            pos_in_seq=pos_in_seq,
            query_lens_cpu=list(batch.query_lens_cpu),
            is_decode=is_decode,
            cu_seqlens_long=None if is_decode else qsl.long(),
            chunk_indices=None if is_decode else _chunk_indices(batch.query_lens_cpu, qsl),
            valid=valid,
            state_cu_seqlens=state_cu_seqlens,
        )


def _verify_steps(batch: ForwardBatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Position j reads the state position j-1 left (the sequence's own slot for j = 0) and writes its own to
    verify_slots[:, j]: the sequence's slot is only read (ModelRunner.rollback trades in the accepted one)."""
    # [width, B], each position's slots contiguous: the kernels read slot n at SLOT + n
    own, scratch = batch.state_slots.long(), batch.verify_slots.long().t().contiguous()
    width = batch.verify_width
    ins = [own] + [scratch[j] for j in range(width - 1)]
    outs = [scratch[j] for j in range(width)]
    return list(zip(ins, outs))


def _chunk_indices(query_lens: list[int], query_start_loc: torch.Tensor) -> torch.Tensor:
    """(sequence, chunk) of every CHUNK_SIZE-token chunk of a varlen batch: fla's `chunk_indices`.

    Built on the device from the batch's offsets; only the row count comes from the host lengths.
    No upload, so a CUDA-graph capture bakes in no host buffer and replays it for any batch of
    the same lengths' chunk count.
    """
    num_chunks = sum(-(-n // CHUNK_SIZE) for n in query_lens)
    qsl = query_start_loc.long()
    per_seq = (qsl[1:] - qsl[:-1] + CHUNK_SIZE - 1) // CHUNK_SIZE
    ends = per_seq.cumsum(0)
    chunk = torch.arange(num_chunks, device=qsl.device)
    seq = torch.searchsorted(ends, chunk, right=True)
    return torch.stack([seq, chunk - (ends - per_seq)[seq]], dim=1)


def _gather_state(cache: torch.Tensor, meta: GDNMetadata) -> torch.Tensor:
    """States of the batch's sequences; zero where nothing is cached (the slot may hold anything, even NaN)."""
    state = cache.index_select(0, meta.state_slots)
    keep = meta.has_initial_state.view(-1, *([1] * (state.dim() - 1)))
    return torch.where(keep, state, torch.zeros((), dtype=state.dtype, device=state.device))


# ---------------------------------------------------------------------------------------------
# Model-facing entry points


def short_conv(x: torch.Tensor, weight: torch.Tensor, conv_cache: torch.Tensor, meta: GDNMetadata) -> torch.Tensor:
    """Causal depthwise conv + SiLU over a ragged batch.

    x: [T, C] pre-conv qkv; weight: [C, K] (or the checkpoint's [C, 1, K]);
    conv_cache: [S, C, K-1] one layer's conv-state slots, updated in place. Returns [T, C].
    """
    weight = weight.reshape(weight.shape[0], -1)
    if meta.verify_steps is not None:
        return _conv_steps(x, weight, conv_cache, meta)
    if meta.is_decode and use_triton(x):
        from ninfer.kernels import triton_gdn

        return triton_gdn.conv1d_update(x, weight, conv_cache, slot_in=meta.state_slots,
                                        has_initial_state=meta.has_initial_state)
    initial = _gather_state(conv_cache, meta)
    if meta.is_decode:
        out, final = causal_conv1d_update(x, weight, initial)
    else:
        out, final = causal_conv1d_fn(x, weight, initial, meta.cu_seqlens, meta.seq_idx, meta.pos_in_seq,
                                      state_cu_seqlens=meta.state_cu_seqlens)
    conv_cache.index_copy_(0, meta.state_slots, final.to(conv_cache.dtype))
    return out


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: GDNGates, ssm_cache: torch.Tensor, meta: GDNMetadata,
) -> torch.Tensor:
    """Gated delta rule over a ragged batch; q/k are L2-normalised and q scaled inside.

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; gates: beta and the log decay g, [T, Hv] each, from the layer's projections;
    ssm_cache: [S, Hv, Dk, Dv] fp32 one layer's state slots, updated in place. Returns [T, Hv, Dv].
    """
    if meta.verify_steps is not None:
        return _delta_rule_steps(q, k, v, gates, ssm_cache, meta)
    if meta.is_decode and use_triton(q):
        from ninfer.kernels import triton_gdn

        return triton_gdn.recurrent_gated_delta_rule(q, k, v, state_in=ssm_cache, slot_in=meta.state_slots,
                                                     has_initial_state=meta.has_initial_state,
                                                     **gates.kernel_args(v.dtype))
    beta, g = gates.values()
    initial = _gather_state(ssm_cache, meta)
    if meta.is_decode:
        # one token per sequence: a batch of N length-1 sequences, no varlen bookkeeping needed
        out, final = fused_recurrent_gated_delta_rule(
            q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None],
            initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True,
        )
        out = out[:, 0]
    else:
        if meta.valid is not None:  # padding: no decay, no update (torch.where keeps real rows bit for bit)
            g = torch.where(meta.valid, g, torch.zeros((), dtype=g.dtype, device=g.device))
            beta = torch.where(meta.valid, beta, torch.zeros((), dtype=beta.dtype, device=beta.device))
        out, final = chunk_gated_delta_rule(
            q[None], k[None], v[None], g[None], beta[None],
            initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True,
            cu_seqlens=meta.cu_seqlens_long, seq_lens_cpu=meta.query_lens_cpu, chunk_indices=meta.chunk_indices,
        )
        out = out[0]
    ssm_cache.index_copy_(0, meta.state_slots, final.to(ssm_cache.dtype))
    return out


def _by_position(x: torch.Tensor, meta: GDNMetadata) -> torch.Tensor:
    """[B * width, ...] -> [B, width, ...]: a verify batch's tokens by sequence and position (a view)."""
    return x.view(len(meta.query_lens_cpu), meta.query_lens_cpu[0], *x.shape[1:])


def _conv_steps(x: torch.Tensor, weight: torch.Tensor, conv_cache: torch.Tensor, meta: GDNMetadata) -> torch.Tensor:
    """short_conv over a verify batch: one decode step per position (the decode step's arithmetic, so a verified
    position computes what plain decoding computes there); with Triton all positions in one launch."""
    triton = use_triton(x)
    if triton:
        from ninfer.kernels import triton_gdn

        if FUSED_VERIFY_STEPS:
            return triton_gdn.conv1d_steps(x, weight, conv_cache, meta.verify_steps[0][0], meta.verify_out_slots)
    y = torch.empty_like(x)
    xs, ys = _by_position(x, meta), _by_position(y, meta)
    for j, (slot_in, slot_out) in enumerate(meta.verify_steps):
        if triton:
            triton_gdn.conv1d_update(xs[:, j], weight, conv_cache, slot_in=slot_in, slot_out=slot_out, out=ys[:, j])
        else:
            out, final = causal_conv1d_update(xs[:, j], weight, conv_cache.index_select(0, slot_in))
            ys[:, j] = out
            conv_cache.index_copy_(0, slot_out, final.to(conv_cache.dtype))
    return y


def _delta_rule_steps(q, k, v, gates: GDNGates, ssm_cache: torch.Tensor, meta: GDNMetadata) -> torch.Tensor:
    """gated_delta_rule over a verify batch: one recurrent step per position, each state kept in its slot (with
    Triton all positions in one launch, each state read once)."""
    triton = use_triton(q)
    if triton:
        from ninfer.kernels import triton_gdn

        if FUSED_VERIFY_STEPS:
            return triton_gdn.recurrent_gated_delta_rule_steps(q, k, v, state=ssm_cache,
                                                               slot_in=meta.verify_steps[0][0],
                                                               slot_out=meta.verify_out_slots,
                                                               **gates.kernel_args(v.dtype))
    beta, g = gates.values()  # (the one-step launches below take the values: the gates kernel's, bit for bit)
    o = torch.empty_like(v)
    qs, ks, vs, gs, bs, os_ = (_by_position(t, meta) for t in (q, k, v, g, beta, o))
    for j, (slot_in, slot_out) in enumerate(meta.verify_steps):
        if triton:
            triton_gdn.recurrent_gated_delta_rule(qs[:, j], ks[:, j], vs[:, j], gs[:, j], bs[:, j], ssm_cache,
                                                  slot_in=slot_in, slot_out=slot_out, out=os_[:, j])
        else:
            out, final = fused_recurrent_gated_delta_rule(
                qs[:, j, None], ks[:, j, None], vs[:, j, None], g=gs[:, j, None], beta=bs[:, j, None],
                initial_state=ssm_cache.index_select(0, slot_in), output_final_state=True,
                use_qk_l2norm_in_kernel=True)
            os_[:, j] = out[:, 0]
            ssm_cache.index_copy_(0, slot_out, final.to(ssm_cache.dtype))
    return o


# ---------------------------------------------------------------------------------------------
# Dispatch: one function per op. CUDA tensors take the Triton / fla-core backends when available;
# the references run everywhere else (they are plain tensor ops and also run on CUDA).


def causal_conv1d_fn(
    x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor, cu_seqlens: torch.Tensor,
    seq_idx: torch.Tensor, pos_in_seq: torch.Tensor, state_cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen conv + SiLU. x: [T, C]; weight: [C, K]; initial_state: [N, C, K-1]. -> (y [T, C], final [N, C, K-1]).
    state_cu_seqlens: where each sequence's final state is taken (default cu_seqlens; padding ends earlier)."""
    if use_triton(x):
        from ninfer.kernels import triton_gdn

        out = triton_gdn.conv1d_varlen(x, weight, initial_state, seq_idx, pos_in_seq)
    else:
        out, final = causal_conv1d_ref(x, weight, initial_state, cu_seqlens, seq_idx, pos_in_seq)
        if state_cu_seqlens is None:
            return out, final
    return out, _conv_final_state(x, initial_state, cu_seqlens if state_cu_seqlens is None else state_cu_seqlens)


def causal_conv1d_update(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of conv + SiLU. x: [N, C]; state: [N, C, K-1]. -> (y [N, C], new state)."""
    if use_triton(x):
        from ninfer.kernels import triton_gdn

        new_state = torch.empty_like(state)
        return triton_gdn.conv1d_update(x, weight, state.contiguous(), new_state), new_state
    return causal_conv1d_update_ref(x, weight, state)


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float | None = None, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, cu_seqlens: torch.Tensor | None = None,
    seq_lens_cpu: list[int] | None = None, chunk_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla-core's signature: q, k [1, T, Hk, Dk]; v [1, T, Hv, Dv]; g, beta [1, T, Hv]; states [N, Hv, Dk, Dv].

    seq_lens_cpu (ours, optional) spares the reference reading cu_seqlens back from the device;
    chunk_indices (fla's, optional) spares fla building and uploading its chunk table per call.
    """
    if use_fla(q):
        from ninfer.kernels import fla_gdn

        return fla_gdn.chunk_gated_delta_rule(
            q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
            seq_lens_cpu, chunk_indices,
        )
    return chunk_gated_delta_rule_ref(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
        seq_lens_cpu,
    )


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float | None = None, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla-core's signature (dense batch): q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv].

    fla orders the arguments g, gk, gv, beta: always pass beta by keyword.
    """
    if use_fla(q):
        from ninfer.kernels import fla_gdn

        return fla_gdn.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
        )
    return fused_recurrent_gated_delta_rule_ref(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
    )


# ---------------------------------------------------------------------------------------------
# Torch references


def causal_conv1d_ref(
    x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor, cu_seqlens: torch.Tensor,
    seq_idx: torch.Tensor, pos_in_seq: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    # Tap d reads the input d steps back: a new token of the same sequence, or a column of the
    # sequence's conv state when the window reaches before the chunk. A loop over the K taps only.
    num_tokens, _ = x.shape
    width = initial_state.shape[-1]  # K - 1
    w = weight.float()
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for d in range(width + 1):
        from_x = x[(torch.arange(num_tokens, device=x.device) - d).clamp(min=0)]
        col = (width - d + pos_in_seq).clamp(0, width - 1)
        from_state = initial_state[seq_idx, :, col]  # [T, C]
        u = torch.where((pos_in_seq >= d)[:, None], from_x, from_state)
        acc += w[:, width - d] * u.float()
    out = F.silu(acc).to(x.dtype)
    return out, _conv_final_state(x, initial_state, cu_seqlens)


def _conv_final_state(x: torch.Tensor, initial_state: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """New conv state: the last K-1 inputs of [old state ; new tokens] of each sequence."""
    num_tokens = x.shape[0]
    width = initial_state.shape[-1]
    starts, lens = cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    rel = lens[:, None] - width + torch.arange(width, device=x.device)[None, :]  # [N, K-1], <0 = old state
    tok = (starts[:, None] + rel).clamp(0, max(num_tokens - 1, 0))
    from_x = x[tok].transpose(1, 2)  # [N, C, K-1]
    idx = (width + rel).clamp(0, width - 1)[:, None, :].expand_as(initial_state)
    from_state = initial_state.gather(2, idx)
    return torch.where((rel >= 0)[:, None, :], from_x.to(initial_state.dtype), from_state)


def causal_conv1d_update_ref(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    window = torch.cat([state.to(x.dtype), x[:, :, None]], dim=-1)  # [N, C, K]
    out = F.silu((window.float() * weight.float()).sum(-1)).to(x.dtype)
    return out, window[:, :, 1:].to(state.dtype)


def _prepare_qkv(q, k, v, g, beta, scale, use_qk_l2norm):
    """fp32, q/k heads repeated up to the value heads (value head h reads q/k head h // r), q scaled."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        # eps inside the sqrt, as FLA and transformers do
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    r = v.shape[-2] // q.shape[-2]
    if r > 1:
        q, k = q.repeat_interleave(r, dim=-2), k.repeat_interleave(r, dim=-2)
    q = q * (scale if scale is not None else q.shape[-1] ** -0.5)
    return q, k, v, g, beta


def fused_recurrent_gated_delta_rule_ref(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
):
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare_qkv(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    batch, length, heads, dk = k.shape
    dv = v.shape[-1]
    state = (
        initial_state.float().clone() if initial_state is not None
        else torch.zeros(batch, heads, dk, dv, dtype=torch.float32, device=q.device)
    )
    out = torch.empty(batch, length, heads, dv, dtype=torch.float32, device=q.device)
    for t in range(length):
        state = state * g[:, t].exp()[..., None, None]  # decay before the delta read
        predicted = torch.einsum("bhk,bhkv->bhv", k[:, t], state)
        delta = (v[:, t] - predicted) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], state)  # read after the update
    return out.to(out_dtype), (state if output_final_state else None)


def _chunk_one_sequence(q, k, v, g, beta, state):
    """Chunked gated delta rule for one sequence. q, k: [L, H, Dk]; v: [L, H, Dv]; g, beta: [L, H]; state [H, Dk, Dv]."""
    length = q.shape[0]
    c = CHUNK_SIZE
    pad = (-length) % c
    # Zero padding at the end leaves the state unchanged: g = 0 (no decay), k = 0 (no write).
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, 0, 0, pad)) for t in (g, beta))
    heads = q.shape[1]

    def chunks(t):  # [L, H, ...] -> [H, n, C, ...]
        return t.transpose(0, 1).reshape(heads, -1, c, *t.shape[2:])

    q, k, v, g, beta = (chunks(t) for t in (q, k, v, g, beta))
    cum = g.cumsum(-1)  # G_i: log-decay from the chunk start through token i
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    gamma = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # UT transform: (I + StrictLower(diag(beta) K K^T o Gamma)) [U | W] = [diag(beta) V | diag(beta) K o exp(G)]
    a = ((k_beta @ k.transpose(-1, -2)) * gamma).tril(-1)
    eye = torch.eye(c, dtype=a.dtype, device=a.device)
    rhs = torch.cat([v_beta, k_beta * cum.exp()[..., None]], dim=-1)
    uw = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    u, w = uw.split([v.shape[-1], k.shape[-1]], dim=-1)
    attn = (q @ k.transpose(-1, -2)) * gamma  # intra-chunk, lower incl. diagonal
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(v)
    for i in range(q.shape[1]):  # sequential scan over chunks
        v_new = u[:, i] - w[:, i] @ state
        out[:, i] = q_decayed[:, i] @ state + attn[:, i] @ v_new
        state = state * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(heads, -1, v.shape[-1])[:, :length].transpose(0, 1)
    return out, state


def chunk_gated_delta_rule_ref(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
    cu_seqlens=None, seq_lens_cpu=None,
):
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare_qkv(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    if cu_seqlens is None:  # dense batch [B, T, ...]: flatten into a varlen batch of B equal sequences
        batch, length = q.shape[:2]
        q, k, v, g, beta = (t.reshape(1, batch * length, *t.shape[2:]) for t in (q, k, v, g, beta))
        seq_lens_cpu = [length] * batch
    elif seq_lens_cpu is None:
        seq_lens_cpu = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    heads, dk, dv = v.shape[2], k.shape[-1], v.shape[-1]
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    finals = []
    start = 0
    for n, length in enumerate(seq_lens_cpu):
        state = (
            initial_state[n].float() if initial_state is not None
            else torch.zeros(heads, dk, dv, dtype=torch.float32, device=v.device)
        )
        sl = slice(start, start + length)
        out[0, sl], state = _chunk_one_sequence(q[0, sl], k[0, sl], v[0, sl], g[0, sl], beta[0, sl], state)
        finals.append(state)
        start += length
    if cu_seqlens is None:
        out = out.reshape(len(seq_lens_cpu), -1, heads, dv)
    final = torch.stack(finals) if output_final_state else None
    return out.to(out_dtype), final
