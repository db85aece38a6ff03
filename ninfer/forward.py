"""What one model traversal runs on: a ragged batch plus the caches the caller owns.

A batch mixes sequences that prefill a chunk with sequences that decode one token. Tokens of
all sequences are concatenated; `query_start_loc` marks where each sequence's new tokens start.
The attention metadata travels in this one object instead of through every layer's signature.

KV storage (`--kv-dtype`, `ModelCache(kv_dtype=...)`):
- `bf16`: K/V unquantized in the model's activation dtype (bf16 on CUDA, fp32 for CPU models).
- `fp8`: float8_e4m3fn; `int8`: symmetric int8. Both keep one fp32 scale per (token slot, KV head)
  in `k_scale` / `v_scale` [layers, slots, kv_heads], computed when the token is written
  (amax over head_dim / 448, resp. / 127): no calibration, nothing can overflow, and a token's
  bytes never change after it is written, so prefix reuse, page copies and host snapshots stay
  exact. fp32 rather than bf16 scales: the scale is then exact (no second rounding to track), the
  scale loads stay 4-byte aligned, and the cost is 4 bytes per 128-256 quantized bytes (1.6 % of
  a 256-dim head, 3.1 % at 128).
- `nvfp4`: K and V as NVFP4 rows (the weights' format, `ninfer.quant.nvfp4`, per (slot, KV head)):
  the cache tensor is uint8 [layers, slots, kv_heads, D/2 + D/16] (head_dim D % 16 == 0), each row
  the D/2 bytes of E2M1 codes (two per byte, element 2j in the low nibble, 2j+1 in the high one)
  followed by D/16 E4M3 block scales (bytes of float8_e4m3fn), one per 16 consecutive elements;
  `k_scale` / `v_scale` [layers, slots, kv_heads] fp32 is the second level. Element j of a row is
  e2m1(code_j) * e4m3(block_{j // 16}) * scale. The scale is amax / (448 * 6) so that block scales
  use E4M3's range (a block holding the row's amax gets 448) and the values E2M1's (up to 6).
  Codes and block scales share one row so that every per-slot copy (page copies, prefix reuse, host
  snapshots) moves them together, exactly as it moves fp8/int8 rows: three per-slot tensors, as
  for fp8/int8, and `ModelCache.layer` keeps its (k, v, k_scale, v_scale) shape.
- `k8v4`: K as `int8` (values and fp32 scale as above), V as `nvfp4`: the keys, whose errors move
  the softmax, keep 8 bits; the values, whose errors only average, take 4.
A cache tensor's dtype says how to read it (`ninfer.kernels.attention`): float8_e4m3fn and int8
rows are one byte per element with a scale, uint8 rows are NVFP4.
Bytes per token and KV head at D = 256: bf16 1024; fp8 / int8 2 * (256 + 4) = 520; nvfp4
2 * (128 + 16 + 4) = 296; k8v4 260 + 148 = 408.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64: new tokens of every sequence, concatenated
    positions: torch.Tensor  # [T] int64 text positions, or [3, T] MRoPE (t, h, w) positions
    query_start_loc: torch.Tensor  # [B+1] int32: cumulative new-token counts
    seq_lens: torch.Tensor  # [B] int32: context length after this step (prefix already cached + new)
    page_table: torch.Tensor  # [B, P] int32: KV pages of each sequence, in order
    slot_mapping: torch.Tensor  # [T] int64: flat KV slot (page * page_size + offset) of each new token
    state_slots: torch.Tensor  # [B] int64: recurrent-state slot of each sequence (hybrid models)
    query_lens_cpu: list[int]  # host copies: the torch reference kernels loop over sequences
    seq_lens_cpu: list[int]
    logits_indices: torch.Tensor | None = None  # rows to compute logits for; None = last token of each sequence
    inputs_embeds: torch.Tensor | None = None  # [T, H] replaces the embedding lookup (media spans)
    # [1] int64, a padded one-sequence prefill only: its first num_valid tokens are real, the rest
    # padding (KV slot -1: nothing written; no recurrent-state change; no logits), so that a prompt
    # can replay the CUDA graph of a longer forward
    num_valid: torch.Tensor | None = None
    # a speculative verify batch (`verify_inputs`): every sequence appends `verify_width` tokens (its
    # last committed token and its drafts, padded up to the width), each with a logit row. Attention runs
    # them as one-query decode rows (`row_seq_lens` [T] int32: the context each row sees, padding
    # clamped to the sequence's last real row); the recurrent layers step position by position, the
    # state after position j going to `verify_slots[:, j]` ([B, width] int64) while the sequence's own
    # slot is only read, so any accepted position is restored by trading one slot (ModelRunner.rollback)
    verify_width: int = 0
    row_seq_lens: torch.Tensor | None = None
    row_seq_lens_cpu: list[int] | None = None
    verify_slots: torch.Tensor | None = None
    # tensors computed from the inputs once per forward and shared by the layers (the verify batch's
    # decode-row view); whoever runs a forward clears it first (ModelRunner._logits), so a CUDA graph
    # captures their computation instead of baking in values from a warm-up's inputs
    derived: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def is_decode(self) -> bool:
        """Every sequence advances by exactly one token (the CUDA-graph-capturable shape)."""
        return not self.verify_width and all(n == 1 for n in self.query_lens_cpu)

    def row_page_table(self) -> torch.Tensor:
        """A verify batch's page table with one row per token (each sequence's row repeated)."""
        return self.page_table.repeat_interleave(self.verify_width, dim=0,
                                                 output_size=self.page_table.shape[0] * self.verify_width)

    def logit_indices(self) -> torch.Tensor:
        """The rows logits are computed for: `logits_indices` when set (every verified position), else
        each sequence's last real token."""
        return self.logits_indices if self.logits_indices is not None else self.last_token_indices()

    def last_token_indices(self) -> torch.Tensor:
        if self.num_valid is not None:
            return self.num_valid.long() - 1
        return self.query_start_loc[1:].long() - 1

    @classmethod
    def build(
        cls,
        tokens: list[list[int]],
        cached_lens: list[int],
        page_tables: list[list[int]],
        page_size: int,
        state_slots: list[int] | None = None,
        device: torch.device | str = "cpu",
        pad_to: int | None = None,
        positions: list | None = None,
        all_logits: bool = False,
    ) -> "ForwardBatch":
        """Build a batch from host lists (`host_inputs`, whose arguments these are): sequence i appends
        tokens[i] after cached_lens[i] cached tokens. all_logits: a logit row for every new token
        (speculative verification), else for each sequence's last one."""
        h = host_inputs(tokens, cached_lens, page_tables, page_size, state_slots, pad_to, positions)

        def t(data, dtype):
            return torch.as_tensor(data, dtype=dtype).to(device)

        return cls(
            input_ids=t(h.input_ids, torch.long),
            positions=t(h.positions, torch.long),
            query_start_loc=t(h.query_start_loc, torch.int32),
            seq_lens=t(h.seq_lens, torch.int32),
            page_table=t(h.page_table, torch.int32),
            slot_mapping=t(h.slot_mapping, torch.long),
            state_slots=t(h.state_slots, torch.long),
            query_lens_cpu=h.query_lens,
            seq_lens_cpu=h.seq_lens.tolist(),
            logits_indices=t(np.arange(len(h.input_ids)), torch.long) if all_logits else None,
            num_valid=None if h.num_valid is None else t([h.num_valid], torch.long),
        )


    @classmethod
    def for_verify(cls, h: "HostInputs", device: torch.device | str = "cpu") -> "ForwardBatch":
        """The eager batch of `verify_inputs`' host arrays (uploads through `upload` when given)."""

        def t(data, dtype):
            return torch.as_tensor(data, dtype=dtype).to(device)

        return cls(
            input_ids=t(h.input_ids, torch.long), positions=t(h.positions, torch.long),
            query_start_loc=t(h.query_start_loc, torch.int32), seq_lens=t(h.seq_lens, torch.int32),
            page_table=t(h.page_table, torch.int32), slot_mapping=t(h.slot_mapping, torch.long),
            state_slots=t(h.state_slots, torch.long), query_lens_cpu=h.query_lens, seq_lens_cpu=h.seq_lens.tolist(),
            logits_indices=t(np.arange(len(h.input_ids)), torch.long), verify_width=h.verify_width,
            row_seq_lens=t(h.row_seq_lens, torch.int32), row_seq_lens_cpu=h.row_seq_lens.tolist(),
            verify_slots=t(h.verify_slots, torch.long),
        )


@dataclass
class HostInputs:
    """A step's model inputs as host arrays: what both the eager path (ForwardBatch.build) and the CUDA
    graphs' static buffers (ninfer.engine.graphs) are filled from, so both see the same values."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64, or [3, T] MRoPE (t, h, w) when a sequence brings its own
    slot_mapping: np.ndarray  # [T] int64; -1 for padding (no KV written)
    query_start_loc: np.ndarray  # [B+1] int32
    seq_lens: np.ndarray  # [B] int32
    state_slots: np.ndarray  # [B] int64
    page_tables: list[list[int]]  # each sequence's pages (the padding's positions included)
    query_lens: list[int]
    num_valid: int | None = None  # a padded one-sequence prefill: its real tokens
    verify_width: int = 0  # a verify batch (verify_inputs): tokens per sequence, padding included
    row_seq_lens: np.ndarray | None = None  # [T] int32, verify batches: the context of each row
    verify_slots: np.ndarray | None = None  # [B, width] int64, verify batches: per-position state slots

    @property
    def page_table(self) -> np.ndarray:
        """[B, width] int32, rows padded with page 0."""
        width = max((len(p) for p in self.page_tables), default=0) or 1
        table = np.zeros((len(self.page_tables), width), dtype=np.int32)
        for i, pages in enumerate(self.page_tables):
            table[i, : len(pages)] = pages
        return table


class DeviceOnlyLengths(list):
    """Host lengths of a captured batch: only their count is known. Reading a value means a kernel
    would bake one step's lengths into the graph, so it raises (and capture falls back to eager)."""

    def __getitem__(self, index):
        raise RuntimeError("a CUDA-graph batch has no host sequence lengths (reference kernel in graph?)")

    def __iter__(self):
        raise RuntimeError("a CUDA-graph batch has no host sequence lengths (reference kernel in graph?)")


def host_inputs(tokens: list[list[int]], cached_lens: list[int], page_tables: list[list[int]], page_size: int,
                state_slots: list[int] | None = None, pad_to: int | None = None,
                positions: list | None = None) -> HostInputs:
    """Sequence i appends tokens[i] at positions cached_lens[i].. (or positions[i], a [3, n] MRoPE array,
    where given and not None: text positions are the case where the three axes agree).
    pad_to (one sequence only): append padding tokens up to that many (ForwardBatch.num_valid)."""
    if pad_to is None and positions is None and all(len(t) == 1 for t in tokens):
        return _one_token_inputs(tokens, cached_lens, page_tables, page_size, state_slots)
    num_valid = None
    if pad_to is not None:
        if len(tokens) != 1 or pad_to < len(tokens[0]):
            raise ValueError("pad_to needs one sequence of at most pad_to tokens")
        num_valid = len(tokens[0])
        cached, pages = cached_lens[0], page_tables[0]
        tokens = [list(tokens[0]) + [0] * (pad_to - num_valid)]
        # the padding's positions need page-table entries (their keys are read by padding queries only)
        page_tables = [list(pages) + [0] * max(0, -(-(cached + pad_to) // page_size) - len(pages))]
    lens = [len(x) for x in tokens]
    starts = np.zeros(len(tokens) + 1, dtype=np.int32)
    np.cumsum(lens, out=starts[1:])
    pos_parts, slot_parts = [], []
    for toks, cached, pages in zip(tokens, cached_lens, page_tables):
        pos = np.arange(cached, cached + len(toks), dtype=np.int64)
        table = np.asarray(pages, dtype=np.int64)
        real = len(toks) if num_valid is None else num_valid
        slots = np.full(len(toks), -1, dtype=np.int64)
        slots[:real] = table[pos[:real] // page_size] * page_size + pos[:real] % page_size
        pos_parts.append(pos)
        slot_parts.append(slots)
    flat_pos = np.concatenate(pos_parts) if pos_parts else np.zeros(0, dtype=np.int64)
    if positions is not None and any(p is not None for p in positions):
        axes = [np.asarray(p, dtype=np.int64) if p is not None else np.broadcast_to(q, (3, len(q)))
                for p, q in zip(positions, pos_parts)]
        if num_valid is not None and axes[0].shape[1] < len(pos_parts[0]):  # padding continues on every axis
            extra = axes[0][:, -1:] + np.arange(1, len(pos_parts[0]) - axes[0].shape[1] + 1)
            axes[0] = np.concatenate([axes[0], extra], axis=1)
        flat_pos = np.concatenate(axes, axis=1)
    ids = np.fromiter((x for toks in tokens for x in toks), dtype=np.int64, count=int(starts[-1]))
    return HostInputs(
        input_ids=ids,
        positions=flat_pos,
        slot_mapping=np.concatenate(slot_parts) if slot_parts else np.zeros(0, dtype=np.int64),
        query_start_loc=starts,
        seq_lens=np.asarray([c + n for c, n in zip(cached_lens, lens)], dtype=np.int32),
        state_slots=np.asarray(state_slots if state_slots is not None else range(len(tokens)), dtype=np.int64),
        page_tables=page_tables,
        query_lens=lens,
        num_valid=num_valid,
    )


def verify_inputs(rows: list[list[int]], cached_lens: list[int], page_tables: list[list[int]], page_size: int,
                  state_slots: list[int], verify_slots: list[list[int]], width: int,
                  positions: list | None = None) -> HostInputs:
    """A verify batch: sequence i appends rows[i] (its last token and 0..width-1 drafts) at positions
    cached_lens[i].., padded with token 0 up to `width` tokens. Padding writes no KV (slot -1), its
    attention rows see what the last real row sees, and its recurrent steps run into state that is
    never kept (a row's accepted position is always a real one). verify_slots[i]: width state slots, the
    state after each position (the sequence's own slot is only read).
    positions[i]: a [3, width] MRoPE array where given and not None (else text positions)."""
    b = len(rows)
    ids = np.zeros((b, width), dtype=np.int64)
    pos = np.zeros((b, width), dtype=np.int64)
    slots = np.full((b, width), -1, dtype=np.int64)
    row_lens = np.zeros((b, width), dtype=np.int32)
    for i, (toks, cached, pages) in enumerate(zip(rows, cached_lens, page_tables)):
        n = len(toks)
        if not 0 < n <= width:
            raise ValueError(f"a verify row holds 1..{width} tokens, not {n}")
        ids[i, :n] = toks
        pos[i] = np.arange(cached, cached + width)
        real = pos[i, :n]
        slots[i, :n] = np.asarray(pages, dtype=np.int64)[real // page_size] * page_size + real % page_size
        row_lens[i] = cached + np.minimum(np.arange(width), n - 1) + 1
    flat_pos = pos.reshape(-1)
    if positions is not None and any(p is not None for p in positions):
        flat_pos = np.concatenate([np.asarray(p, dtype=np.int64) if p is not None else np.broadcast_to(q, (3, width))
                                   for p, q in zip(positions, pos)], axis=1)
    return HostInputs(
        input_ids=ids.reshape(-1),
        positions=flat_pos,
        slot_mapping=slots.reshape(-1),
        query_start_loc=np.arange(b + 1, dtype=np.int32) * width,
        seq_lens=np.asarray(cached_lens, dtype=np.int32) + width,
        state_slots=np.asarray(state_slots, dtype=np.int64),
        page_tables=page_tables,
        query_lens=[width] * b,
        verify_width=width,
        row_seq_lens=row_lens.reshape(-1),
        verify_slots=np.asarray(verify_slots, dtype=np.int64).reshape(b, width),
    )


def _one_token_inputs(tokens, cached_lens, page_tables, page_size, state_slots) -> HostInputs:
    """host_inputs for rows of one token each (every decode step): plain list arithmetic, which costs
    the host a few microseconds where the general path's per-row arrays cost tens."""
    b = len(tokens)
    slots = [pages[p // page_size] * page_size + p % page_size for p, pages in zip(cached_lens, page_tables)]
    return HostInputs(
        input_ids=np.asarray([t[0] for t in tokens], dtype=np.int64),
        positions=np.asarray(cached_lens, dtype=np.int64),
        slot_mapping=np.asarray(slots, dtype=np.int64),
        query_start_loc=np.arange(b + 1, dtype=np.int32),
        seq_lens=np.asarray(cached_lens, dtype=np.int32) + 1,
        state_slots=np.asarray(state_slots if state_slots is not None else range(b), dtype=np.int64),
        page_tables=page_tables,
        query_lens=[1] * b,
    )


KV_DTYPES = ("bf16", "fp8", "int8", "nvfp4", "k8v4")  # implemented --kv-dtype values
NVFP4_ROW = torch.uint8  # the storage dtype of an NVFP4 row (codes, then block scales)
NVFP4_BLOCK = 16  # elements per E4M3 block scale
# quantized storage dtypes of (K, V) per --kv-dtype
KV_STORAGE = {
    "fp8": (torch.float8_e4m3fn, torch.float8_e4m3fn),
    "int8": (torch.int8, torch.int8),
    "nvfp4": (NVFP4_ROW, NVFP4_ROW),
    "k8v4": (torch.int8, NVFP4_ROW),
}
KV_SCALE_DTYPE = torch.float32


def kv_storage_dtypes(kv_dtype: str, dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """The element dtypes of the K and V tensors: `dtype` (the model's) for bf16, else the quantized ones."""
    if kv_dtype == "bf16":
        return dtype, dtype
    if kv_dtype not in KV_STORAGE:
        raise ValueError(f"KV storage {kv_dtype!r} is not supported (supported: {', '.join(KV_DTYPES)})")
    return KV_STORAGE[kv_dtype]


def kv_row_width(storage: torch.dtype, head_dim: int) -> int:
    """Elements of one (slot, KV head) row: head_dim, or for an NVFP4 row its D/2 code bytes and D/16
    block-scale bytes."""
    if storage != NVFP4_ROW:
        return head_dim
    if head_dim % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 KV needs head_dim % {NVFP4_BLOCK} == 0, not {head_dim}")
    return head_dim // 2 + head_dim // NVFP4_BLOCK


@dataclass(frozen=True)
class CacheSpec:
    """What a model needs its caller to allocate."""

    num_attn_layers: int
    num_kv_heads: int
    head_dim: int
    num_state_layers: int = 0
    conv_dim: int = 0
    conv_width: int = 0  # kernel size - 1: inputs kept for the causal conv
    ssm_heads: int = 0
    ssm_key_dim: int = 0
    ssm_value_dim: int = 0

    def kv_bytes_per_token(self, dtype: torch.dtype, kv_dtype: str = "bf16") -> int:
        """K and V bytes of one token over all attention layers (quantized: values, NVFP4 block scales
        and fp32 scales); `dtype` is the model's activation dtype, used when kv_dtype is bf16."""
        per_head = 0
        for storage in kv_storage_dtypes(kv_dtype, dtype):
            per_head += kv_row_width(storage, self.head_dim) * storage.itemsize
            if kv_dtype in KV_STORAGE:
                per_head += KV_SCALE_DTYPE.itemsize
        return self.num_attn_layers * self.num_kv_heads * per_head

    def kv_tokens_for_bytes(self, budget_bytes: int, dtype: torch.dtype, kv_dtype: str = "bf16") -> int:
        """How many tokens of KV fit in `budget_bytes` (for sizing a pool from memory)."""
        per_token = self.kv_bytes_per_token(dtype, kv_dtype)
        return budget_bytes // per_token if per_token else 0

    def state_bytes_per_slot(self, conv_dtype: torch.dtype) -> int:
        conv = self.conv_dim * self.conv_width * torch.empty((), dtype=conv_dtype).element_size()
        ssm = self.ssm_heads * self.ssm_key_dim * self.ssm_value_dim * 4
        return self.num_state_layers * (conv + ssm)


class ModelCache:
    """Paged KV slots for full-attention layers and recurrent-state slots for linear-attention layers.

    KV is stored flat per layer ([num_pages * page_size, kv_heads, head_dim]) so a token's slot
    index addresses it directly. The recurrent state is fp32 (the models' ssm dtype).
    Quantized KV (kv_dtype fp8/int8/nvfp4/k8v4, see the module docstring) adds `k_scale` / `v_scale`
    [layers, slots, kv_heads] fp32; whatever copies KV slots must copy these rows too. An NVFP4 K or V
    tensor is [layers, slots, kv_heads, D/2 + D/16] uint8 (codes and block scales in one row).
    """

    def __init__(
        self,
        spec: CacheSpec,
        num_pages: int,
        page_size: int,
        num_state_slots: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        kv_dtype: str = "bf16",
    ):
        self.spec = spec
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_state_slots = num_state_slots
        self.kv_dtype = kv_dtype
        slots = num_pages * page_size
        shape = (spec.num_attn_layers, slots, spec.num_kv_heads)
        k_storage, v_storage = kv_storage_dtypes(kv_dtype, dtype)
        self.k = torch.zeros((*shape, kv_row_width(k_storage, spec.head_dim)), dtype=k_storage, device=device)
        self.v = torch.zeros((*shape, kv_row_width(v_storage, spec.head_dim)), dtype=v_storage, device=device)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if kv_dtype in KV_STORAGE:
            self.k_scale = torch.zeros(shape, dtype=KV_SCALE_DTYPE, device=device)
            self.v_scale = torch.zeros(shape, dtype=KV_SCALE_DTYPE, device=device)
        n = spec.num_state_layers
        self.conv = torch.zeros((n, num_state_slots, spec.conv_dim, spec.conv_width), dtype=dtype, device=device)
        self.ssm = torch.zeros(
            (n, num_state_slots, spec.ssm_heads, spec.ssm_key_dim, spec.ssm_value_dim),
            dtype=torch.float32, device=device,
        )

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Attention layer i's (k, v, k_scale, v_scale): values [S, Hkv, D] (NVFP4: [S, Hkv, D/2 + D/16]
        uint8) and, for a quantized cache, fp32 scales [S, Hkv] (else None); what `write_kv` and
        `paged_attention` take."""
        if self.k_scale is None:
            return self.k[i], self.v[i], None, None
        return self.k[i], self.v[i], self.k_scale[i], self.v_scale[i]

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def kv_bytes(self) -> int:
        """Device bytes of the KV pool (values and scales)."""
        tensors = (self.k, self.v, self.k_scale, self.v_scale)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.spec.kv_bytes_per_token(self.k.dtype, self.kv_dtype)  # k.dtype is the model's for bf16
