"""The native CPU decode step (ninfer/kernels/cpu_decode.c): built once per machine with the system C
compiler, loaded with ctypes, called once per decode step (issue 23).

Why C and not torch: a SmolLM2-135M decode step is a 135 MB stream of int8 weights. torch's int8
weight-only kernel reads ~5 GB/s a core and ~300 small ops cost ~5 ms a step; the C step reads the
weights at ~16-20 GB/s a core (AVX-512 VNNI) and has no per-op cost, and its attention reads the paged
context in place. The library is compiled with `-march=native` into a per-user cache keyed by the
source, the compiler and the CPU's flags, and links the OpenMP runtime torch already loaded (one thread
pool, not two competing for the cores). Without a compiler, or with NINFER_CPU_NATIVE=0, `library()`
is None and the torch paths run. Where the CPU has AMX (Sapphire Rapids on) and Linux grants the tile
state, the attention takes the tile path; NINFER_CPU_AMX=0 keeps it on the AVX-512 passes.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
import time
from functools import lru_cache
from pathlib import Path

import torch

from ninfer.kernels.cpu_threads import ThreadChooser

log = logging.getLogger("ninfer.kernels")

SOURCE = Path(__file__).with_name("cpu_decode.c")
# larger batches than this (prefill) are compute-bound: torch's kernel takes their logits
MAX_NATIVE_ROWS = 16
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-std=gnu11"]


class QLinear(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


class Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv", QLinear), ("o", QLinear),
                ("gate_up", QLinear), ("down", QLinear)]


class Model(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in
                ("layers", "hidden", "heads", "kv_heads", "head_dim", "inter", "threads")] + [
        ("eps", ctypes.c_float), ("attn_scale", ctypes.c_float), ("layer", ctypes.POINTER(Layer)),
        ("final_norm", ctypes.c_void_p), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
        ("k_scale", ctypes.c_void_p), ("v_scale", ctypes.c_void_p)] + [
        (name, ctypes.c_int64) for name in ("k_kind", "v_kind", "k_layer_bytes", "v_layer_bytes", "scale_layer_stride")]


# KV storage the C step reads (cpu_decode.c's KV_*): bf16, int8 rows, NVFP4 rows (ninfer.forward); fp8 caches
# keep to the torch path
KV_KINDS = {torch.bfloat16: 0, torch.int8: 1, torch.uint8: 2}


def kv_kind(cache: torch.Tensor, scale: torch.Tensor | None) -> int | None:
    """The C kind of a cache tensor (with its scales where quantized), or None where the C step does not read it."""
    kind = KV_KINDS.get(cache.dtype)
    if kind is None or (kind > 0) != (scale is not None) or not cache.is_contiguous():
        return None
    if scale is not None and not (scale.dtype == torch.float32 and scale.is_contiguous()):
        return None
    return kind


def _cache_dir() -> Path:
    root = os.environ.get("NINFER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ninfer")
    return Path(root) / "cpu_native"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _compiler() -> str:
    return os.environ.get("CC", "cc")


def build(extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile the library (if this source, compiler and CPU have no build yet) and return its path.
    Concurrent builders (Ray replicas starting together) each write a temporary file and rename it."""
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    flags = [*FLAGS, *extra_flags]
    key = hashlib.sha256("\0".join([SOURCE.read_text(), version, " ".join(flags), _cpu_flags()]).encode())
    out = _cache_dir() / f"cpu_decode-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True, check=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.ninfer_llama_decode.argtypes = [ctypes.POINTER(Model), i64, ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, ptr]
    lib.ninfer_llama_decode.restype = ctypes.c_int
    lib.ninfer_qlinear_bf16.argtypes = [ctypes.POINTER(QLinear), i64, ptr, ptr, i64]
    lib.ninfer_qlinear_bf16.restype = ctypes.c_int
    lib.ninfer_decode_attention.argtypes = [i64, i64, i64, i64, ptr, ctypes.c_float, ptr, ptr, ptr, ptr, i64, i64,
                                            ptr, i64, ptr, i64, ptr, i64]
    lib.ninfer_decode_attention.restype = ctypes.c_int
    lib.ninfer_quantize_kv.argtypes = [ptr, i64, i64, i64, ptr, ptr]
    lib.ninfer_quantize_kv.restype = ctypes.c_int
    lib.ninfer_dequantize_kv.argtypes = [ptr, ptr, i64, i64, i64, ptr]
    lib.ninfer_dequantize_kv.restype = ctypes.c_int
    lib.ninfer_amx.argtypes = [i64]
    lib.ninfer_amx.restype = ctypes.c_int
    lib.ninfer_amx(int(os.environ.get("NINFER_CPU_AMX", "1") != "0"))
    return lib


def set_amx(on: bool) -> bool:
    """Turn the attention's AMX tile path on (where the CPU and kernel allow it) or off; returns whether it is on."""
    lib = library()
    return bool(lib is not None and lib.ninfer_amx(int(on)))


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded library, or None (disabled, or no working compiler: logged once)."""
    if os.environ.get("NINFER_CPU_NATIVE", "1") == "0":
        return None
    try:
        return load(build())
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("native CPU decode step unavailable, using torch ops: %s", str(detail).strip()[:500])
        return None


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _qlinear(module) -> QLinear:
    return QLinear(_ptr(module.weight_int8), _ptr(module.scale), module.out_features, module.in_features)


# Threads of a native decode step (and its logits), where the process sets them apart from torch's (the
# served Engine replica: ninfer.server.startup); None: torch's thread count.
decode_threads: int | None = None
# From this many context tokens (a decode batch's longest), a step takes torch's threads (the replica's every
# core) all the same: attention over the context then outweighs what the router and Ray lose by sharing the
# last core. Through HTTP on 2 cores (bench/results/2026-12-03-cpu-s14, quiet runs), one decode thread against
# two: 81.8 / 73.1 / 55.9 / 40.2 against 62.2 / 60.6 / 58.0 / 46.0 tok/s at 128 / 1k / 3k / 6k tokens, even
# near 2.7k.
LONG_CONTEXT_TOKENS = 2560


# The served replica's measured choice among thread counts (ninfer.kernels.cpu_threads; ninfer.server.startup sets
# it unless NINFER_CPU_THREADS fixes the count); it overrides decode_threads and LONG_CONTEXT_TOKENS.
thread_chooser: ThreadChooser | None = None


def _threads(context: int | None = None, batch: int = 1) -> int:
    """A step's threads: the chooser's for this context and batch (context None: its last step's); without one,
    decode_threads below LONG_CONTEXT_TOKENS of context, else torch's."""
    if thread_chooser is not None:
        return thread_chooser.last if context is None else thread_chooser.pick(context, batch)
    if decode_threads and (context or 0) < LONG_CONTEXT_TOKENS:
        return decode_threads
    return max(decode_threads or 0, torch.get_num_threads())


class NativeLlamaDecode:
    """A Llama model's decode step in C: int8 weight-only matmuls without bias, RMSNorm weights in bf16, a bf16,
    int8, nvfp4 or k8v4 KV cache (`takes`). Holds the tensors whose addresses the C structs carry (the plan is rebuilt whenever the model's
    modules or tensors change: models.llama drops it)."""

    def __init__(self, lib: ctypes.CDLL, model_struct: Model, layers, keep: list[torch.Tensor], hidden: int):
        self.lib, self.struct, self.layers, self.keep, self.hidden = lib, model_struct, layers, keep, hidden

    @classmethod
    def build(cls, plan) -> "NativeLlamaDecode | None":
        """From a models.llama_cpu.DecodePlan's layer list and the model; None where this step does not apply."""
        from ninfer.quant.int8_cpu import Int8Linear

        lib = library()
        if lib is None:
            return None
        mods = [lp.modules for lp in plan.layers]
        if not all(type(m) is Int8Linear and m.bias is None for group in mods for m in group):
            return None
        norms = [plan.final_norm] + [n for lp in plan.layers for n in (lp.input_norm, lp.post_norm)]
        if any(n.dtype != torch.bfloat16 or not n.is_contiguous() for n in norms):
            return None
        layers = (Layer * len(plan.layers))()
        for i, (lp, group) in enumerate(zip(plan.layers, mods)):
            layers[i] = Layer(_ptr(lp.input_norm), _ptr(lp.post_norm), *(_qlinear(m) for m in group))
        hidden = plan.final_norm.numel()
        struct = Model(len(plan.layers), hidden, plan.heads, plan.kv_heads, plan.head_dim, plan.intermediate, 1,
                       plan.eps, plan.scale, layers, _ptr(plan.final_norm))
        keep = norms + [t for group in mods for m in group for t in (m.weight_int8, m.scale)]
        return cls(lib, struct, layers, keep, hidden)

    def takes(self, cache) -> bool:
        """Whether the C step reads and writes this cache: bf16, int8 or NVFP4 K and V (fp8 keeps to torch)."""
        kinds = kv_kind(cache.k, cache.k_scale), kv_kind(cache.v, cache.v_scale)
        return None not in kinds and (2 not in kinds or self.struct.head_dim % 16 == 0)

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch, cache) -> torch.Tensor:
        """x: [B, H] bf16 embeddings; cos/sin [B, head_dim] fp32. Returns the final-normed hidden states, bf16."""
        x = x.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        b = x.shape[0]
        s = self.struct
        s.k_cache, s.v_cache = _ptr(cache.k), _ptr(cache.v)
        s.k_kind, s.v_kind = kv_kind(cache.k, cache.k_scale), kv_kind(cache.v, cache.v_scale)
        s.k_layer_bytes = cache.k.stride(0) * cache.k.element_size()
        s.v_layer_bytes = cache.v.stride(0) * cache.v.element_size()
        quantized = cache.k_scale is not None
        s.k_scale, s.v_scale = (_ptr(cache.k_scale), _ptr(cache.v_scale)) if quantized else (None, None)
        s.scale_layer_stride = cache.k_scale.stride(0) if quantized else 0
        slots = batch.slot_mapping.contiguous()
        table = batch.page_table.to(torch.int32).contiguous()
        lens = batch.seq_lens.to(torch.int32).contiguous()
        context = int(lens.max())
        s.threads = _threads(context, b)
        out = torch.empty(b, self.hidden, dtype=torch.bfloat16)
        if thread_chooser is not None:
            thread_chooser.started(context, b, s.threads, time.perf_counter())
        rc = self.lib.ninfer_llama_decode(ctypes.byref(s), b, _ptr(x), _ptr(cos), _ptr(sin), _ptr(slots),
                                          _ptr(table), table.stride(0), _ptr(lens), cache.page_size, _ptr(out))
        if rc != 0:
            raise RuntimeError(f"native CPU decode step failed ({rc})")
        if thread_chooser is not None:
            thread_chooser.ended(time.perf_counter())
        return out


def qlinear_logits(module, x: torch.Tensor) -> torch.Tensor | None:
    """fp32 [M, N] = x (bf16 [M, K]) @ the Int8Linear's weight^T, with the decode step's arithmetic; None
    when the library is unavailable or x is not a small batch of bf16 rows (then torch's kernel runs)."""
    lib = library()
    if lib is None or x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[0] > MAX_NATIVE_ROWS or module.bias is not None:
        return None
    x = x.contiguous()
    y = torch.empty(x.shape[0], module.out_features, dtype=torch.float32)
    q = _qlinear(module)
    if lib.ninfer_qlinear_bf16(ctypes.byref(q), x.shape[0], _ptr(x), _ptr(y), _threads()) != 0:
        return None
    return y


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                     seq_lens: torch.Tensor, page_size: int, scale: float, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The C attention alone (tests, benchmarks): q [B, Hq, D]; caches [S, Hkv, row] of one layer (bf16, or int8 /
    NVFP4 rows with their fp32 scales [S, Hkv]); fp32 out. lib: another build of the library (tests)."""
    lib = lib or library()
    assert lib is not None
    q = q.float().contiguous()
    table, lens = page_table.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous()
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    kinds = kv_kind(k_cache, k_scale), kv_kind(v_cache, v_scale)
    assert None not in kinds, (k_cache.dtype, v_cache.dtype)
    out = torch.empty_like(q)
    b, hq, d = q.shape
    rc = lib.ninfer_decode_attention(b, hq, k_cache.shape[1], d, _ptr(q), scale, _ptr(k_cache), _ptr(v_cache),
                                     None if k_scale is None else _ptr(k_scale), None if v_scale is None else _ptr(v_scale),
                                     *kinds, _ptr(table), table.stride(0), _ptr(lens), page_size, _ptr(out), _threads())
    assert rc == 0, rc
    return out


def quantize_kv_rows(x: torch.Tensor, storage: torch.dtype, lib: ctypes.CDLL | None = None):
    """The C step's KV write alone (tests): x [N, D] (bf16 values) -> (rows [N, row] in `storage`, fp32 scales [N]),
    what ninfer.kernels.attention.quantize_kv gives."""
    from ninfer.forward import kv_row_width

    lib = lib or library()
    x = x.float().contiguous()
    n, d = x.shape
    rows = torch.empty(n, kv_row_width(storage, d), dtype=storage)
    scales = torch.empty(n, dtype=torch.float32)
    assert lib.ninfer_quantize_kv(_ptr(x), n, d, KV_KINDS[storage], _ptr(rows), _ptr(scales)) == 0
    return rows, scales


def dequantize_kv_rows(rows: torch.Tensor, scales: torch.Tensor, d: int, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The C attention's expansion of quantized rows to bf16 alone (tests)."""
    lib = lib or library()
    rows, scales = rows.contiguous(), scales.float().contiguous()
    out = torch.empty(rows.shape[0], d, dtype=torch.bfloat16)
    assert lib.ninfer_dequantize_kv(_ptr(rows), _ptr(scales), rows.shape[0], d, KV_KINDS[rows.dtype], _ptr(out)) == 0
    return out
