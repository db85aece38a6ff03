"""fla-core's Triton kernels for the gated delta rule, behind our dispatch signatures.

`chunk_gated_delta_rule` (prefill chunks, varlen through cu_seqlens) and
`fused_recurrent_gated_delta_rule` (dense batches) take the shapes and argument order of
`ninfer.kernels.gdn`'s dispatch functions, which mirror fla's API. Our host copy of the sequence
lengths becomes fla's `cu_seqlens_cpu`, so fla builds its chunk indices without reading the
device; better, the caller's `chunk_indices` (built once per forward, see `GDNMetadata`) spares
fla rebuilding and uploading them in every layer: each such pageable upload blocks the host until
the stream drains, which made 1024-token prefill chunks host-bound. Imported only when a CUDA tensor takes this path (fla is an optional dependency).
"""

from __future__ import annotations

import itertools

import torch
from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk
from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as _fla_recurrent


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float | None = None, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, cu_seqlens: torch.Tensor | None = None,
    seq_lens_cpu: list[int] | None = None, chunk_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    kwargs = {}
    if cu_seqlens is not None:
        kwargs["cu_seqlens"] = cu_seqlens.long()  # no copy when the caller passes int64 already
        if chunk_indices is not None:
            kwargs["chunk_indices"] = chunk_indices
        elif seq_lens_cpu is not None:
            kwargs["cu_seqlens_cpu"] = torch.tensor([0, *itertools.accumulate(seq_lens_cpu)], dtype=torch.long)
    if initial_state is not None:
        initial_state = initial_state.float().contiguous()
    out, final = _fla_chunk(
        q, k, v, g.float(), beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs,
    )
    return out.to(q.dtype), final


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float | None = None, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if initial_state is not None:
        initial_state = initial_state.float().contiguous()
    out, final = _fla_recurrent(
        q, k, v, g=g.float(), beta=beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )
    return out.to(q.dtype), final
