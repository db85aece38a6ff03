"""fla-core's Triton kernels for the gated delta rule, behind our dispatch signatures.

`chunk_gated_delta_rule` (prefill chunks, varlen through cu_seqlens) and
`fused_recurrent_gated_delta_rule` (dense batches) take the shapes and argument order of
`ninfer.kernels.gdn`'s dispatch functions, which mirror fla's API. Our host copy of the sequence
lengths becomes fla's `cu_seqlens_cpu`, so fla builds its chunk indices without reading the
device; better, the caller's `chunk_indices` (built once per forward, see `GDNMetadata`) spares
fla rebuilding and uploading them in every layer: each such pageable upload blocks the host until
the stream drains, which made 1024-token prefill chunks host-bound. Imported only when a CUDA tensor takes this path (fla is an optional dependency).

Prefill calls fla's forward function directly, not its public `chunk_gated_delta_rule`: the public
entry point wraps the same kernels in a backend-dispatch loop, an autograd Function, an argument
guard that inspects every input and an autocast context, which cost ~0.9 ms of host time per call
(48 GDN layers per 1024-token chunk of the 27B shape: 44 ms of a 140 ms chunk whose kernels take
92 ms, H200 profile in bench/results/2026-11-30-h200-s3). Inference needs none of them. fla's
backend dispatch (the same loop around each inner kernel launcher) is switched off for the process
unless the operator set FLA_DISABLE_BACKEND_DISPATCH; fla-core is pinned to 0.6.x in pyproject.toml,
whose internals these are.
"""

from __future__ import annotations

import itertools
import os

os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")  # read by fla at import

import torch  # noqa: E402
from fla.modules.norm.l2norm import l2norm_fwd  # noqa: E402
from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as _fla_recurrent  # noqa: E402
from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd as _fla_chunk_fwd  # noqa: E402
from fla.ops.utils.index import prepare_chunk_indices  # noqa: E402

from ninfer.kernels.gdn import CHUNK_SIZE  # noqa: E402


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float | None = None, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, cu_seqlens: torch.Tensor | None = None,
    seq_lens_cpu: list[int] | None = None, chunk_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.long()  # no copy when the caller passes int64 already
        if chunk_indices is None:
            cu_cpu = None if seq_lens_cpu is None else torch.tensor([0, *itertools.accumulate(seq_lens_cpu)])
            chunk_indices = prepare_chunk_indices(cu_seqlens, CHUNK_SIZE, cu_seqlens_cpu=cu_cpu)
    if initial_state is not None:
        initial_state = initial_state.float().contiguous()
    q, k, v, beta = (t.contiguous() for t in (q, k, v, beta))
    if use_qk_l2norm_in_kernel:
        q, _ = l2norm_fwd(q)
        k, _ = l2norm_fwd(k)
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    with torch.cuda.device(q.device):  # fla's kernels launch on the current device
        _, out, _, final, _, _ = _fla_chunk_fwd(
            q, k, v, g.float().contiguous(), beta, scale, initial_state, output_final_state,
            cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, chunk_size=CHUNK_SIZE,
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
