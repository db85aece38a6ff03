"""A CPU emulator for the few PTX instructions our inline assembly uses (the packed-fp16 NVFP4
GEMV, ninfer/kernels/triton_nvfp4.py), so that kernel runs under Triton's CPU interpreter
(`TRITON_INTERPRET=1`) like the others, and its bit tricks are tested on every run, not only on a
GPU. Registers are uint32 NumPy arrays; fp16 and fp32 arithmetic rounds as PTX's `.rn` does (an fp16
FMA is computed exactly in float64 and rounded once, which matches for the operands we meet)."""

from __future__ import annotations

import re

import numpy as np


def f16_values(bits: np.ndarray) -> np.ndarray:
    return (bits & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)


def f16_bits(values: np.ndarray, saturate: bool = False) -> np.ndarray:
    if saturate:  # .satfinite: out-of-range values clamp to the largest finite fp16
        values = np.clip(values, -65504.0, 65504.0)
    return np.asarray(values).astype(np.float16).view(np.uint16).astype(np.uint32)


def halves(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An f16x2 register as its (low, high) fp16 values."""
    return f16_values(v), f16_values(v >> 16)


def _pair(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return (lo & 0xFFFF) | (hi << 16)


def _f32(v: np.ndarray) -> np.ndarray:
    return v.astype(np.uint32).view(np.float32)


def _e4m3_values(byte: np.ndarray) -> np.ndarray:
    """E4M3 (bias 7, no infinities; 0x7F / 0xFF are NaN) bytes -> float64."""
    sign = np.where(byte & 0x80, -1.0, 1.0)
    exp = (byte >> 3) & 0xF
    man = (byte & 7).astype(np.float64)
    mag = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * 2.0 ** (exp.astype(np.float64) - 7))
    return np.where((byte & 0x7F) == 0x7F, np.nan, sign * mag)


def _lop3(a, b, c, lut: int) -> np.ndarray:
    out = np.zeros_like(a)
    for i in range(8):  # minterm i: a is bit 2 of the index (0xF0), b bit 1 (0xCC), c bit 0 (0xAA)
        if lut >> i & 1:
            out |= (a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)
    return out & 0xFFFFFFFF


def _prmt(a, b, sel: np.ndarray) -> np.ndarray:
    source = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = np.zeros_like(a)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = np.choose(nib & 7, source)
        byte = np.where(nib & 8, np.where(byte & 0x80, 0xFF, 0), byte)  # sign-replicate mode
        out |= byte.astype(np.uint32) << (8 * i)
    return out


def _mma_m16n8k16(a: list, b: list, c: list) -> list[np.ndarray]:
    """mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 over whole warps: operand arrays are flat,
    element i in lane i % 32 of warp i // 32 (the fragment layout of the PTX ISA: lane = 4 g + t)."""
    shape = a[0].shape
    warps = int(np.prod(shape)) // 32
    lanes = np.arange(32)
    g, t = lanes // 4, lanes % 4
    A = np.zeros((warps, 16, 16))
    B = np.zeros((warps, 16, 8))
    for reg, row, col in ((a[0], g, 2 * t), (a[1], g + 8, 2 * t), (a[2], g, 2 * t + 8), (a[3], g + 8, 2 * t + 8)):
        lo, hi = halves(reg.reshape(warps, 32))
        A[:, row, col], A[:, row, col + 1] = lo, hi
    for reg, k in ((b[0], 2 * t), (b[1], 2 * t + 8)):
        lo, hi = halves(reg.reshape(warps, 32))
        B[:, k, g], B[:, k + 1, g] = lo, hi
    D = A @ B  # fp16 products are exact in float64; the sum rounds once, to fp32 below
    out = []
    for reg, row, col in ((c[0], g, 2 * t), (c[1], g, 2 * t + 1), (c[2], g + 8, 2 * t), (c[3], g + 8, 2 * t + 1)):
        acc = _f32(reg.reshape(warps, 32)).astype(np.float64) + D[:, row, col]
        out.append(acc.astype(np.float32).view(np.uint32).reshape(shape))
    return out


def run_ptx(asm: str, operands: list[np.ndarray], n_out: int) -> list[np.ndarray]:
    """Execute `asm` on uint32 arrays (operands are $n_out, $n_out + 1, ...); returns $0..$n_out-1."""
    shape = np.broadcast(*operands).shape
    regs: dict[str, np.ndarray] = {f"${i + n_out}": np.broadcast_to(np.asarray(v).astype(np.uint32), shape)
                                   for i, v in enumerate(operands)}

    def val(tok: str) -> np.ndarray:
        if tok in regs:
            return regs[tok]
        if tok.startswith("0f"):  # PTX's hex fp32 literal
            return np.full(shape, int(tok[2:], 16), dtype=np.uint32)
        return np.full(shape, int(tok, 0), dtype=np.uint32)

    for statement in asm.replace("\n", " ").split(";"):
        statement = statement.strip("{} \t")
        if not statement or statement.startswith(".reg"):
            continue
        op, args = statement.split(None, 1)
        if op == "mov.b32" and args.startswith("{"):
            lo, hi, src = re.match(r"\{(\w+), (\w+)\}, (\S+)", args).groups()
            regs[lo], regs[hi] = val(src) & 0xFFFF, val(src) >> 16
            continue
        if op.startswith("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"):  # (the split ate a last "}")
            groups = [[t.strip() for t in grp.split(",")] for grp in re.findall(r"\{([^}]*)\}?", args)]
            outs = _mma_m16n8k16([val(t) for t in groups[1]], [val(t) for t in groups[2]], [val(t) for t in groups[3]])
            for name, v in zip(groups[0], outs):
                regs[name] = v
            continue
        a = [t.strip() for t in args.split(",")]
        d = a[0]
        if op == "mov.b32":
            regs[d] = val(a[1])
        elif op == "shl.b32":
            regs[d] = ((val(a[1]).astype(np.uint64) << int(a[2], 0)) & 0xFFFFFFFF).astype(np.uint32)
        elif op == "shr.b32":
            regs[d] = val(a[1]) >> int(a[2], 0)
        elif op == "and.b32":
            regs[d] = val(a[1]) & val(a[2])
        elif op == "lop3.b32":
            regs[d] = _lop3(val(a[1]), val(a[2]), val(a[3]), int(a[4], 0))
        elif op == "prmt.b32":
            regs[d] = _prmt(val(a[1]), val(a[2]), val(a[3]))
        elif op in ("mul.rn.f16x2", "fma.rn.f16x2"):
            (alo, ahi), (blo, bhi) = halves(val(a[1])), halves(val(a[2]))
            clo, chi = halves(val(a[3])) if op.startswith("fma") else (0.0, 0.0)
            regs[d] = _pair(f16_bits(alo * blo + clo), f16_bits(ahi * bhi + chi))
        elif op == "add.rn.f16":
            regs[d] = f16_bits(f16_values(val(a[1])) + f16_values(val(a[2])))
        elif op == "cvt.f32.f16":
            regs[d] = f16_values(val(a[1])).astype(np.float32).view(np.uint32)
        elif op == "cvt.rn.f16x2.e4m3x2":  # two E4M3 bytes of a b16 -> fp16 pair, low byte to low half
            src = val(a[1])
            regs[d] = _pair(f16_bits(_e4m3_values(src & 0xFF)), f16_bits(_e4m3_values((src >> 8) & 0xFF)))
        elif op == "mov.f32":
            regs[d] = val(a[1])
        elif op == "fma.rn.f32":
            prod = _f32(val(a[1])).astype(np.float64) * _f32(val(a[2])) + _f32(val(a[3]))
            regs[d] = prod.astype(np.float32).view(np.uint32)
        elif op == "add.f32":
            regs[d] = (_f32(val(a[1])) + _f32(val(a[2]))).view(np.uint32)
        elif op == "cvt.rn.satfinite.f16x2.f32":  # d = (high: a, low: b)
            hi, lo = (_f32(val(t)).astype(np.float64) for t in a[1:3])
            regs[d] = _pair(f16_bits(lo, saturate=True), f16_bits(hi, saturate=True))
        else:
            raise NotImplementedError(f"ptx_emulator: {op}")
    return [regs[f"${i}"] for i in range(n_out)]


class _Results:
    def __init__(self, handles):
        self._handles = handles

    def get_result(self, i):
        return self._handles[i]


def install_interpreter_inline_asm() -> None:
    """Let Triton's interpreter run `tl.inline_asm_elementwise` (pack=1, 32-bit operands) through
    run_ptx. Nothing changes for compiled kernels."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_inline_asm, "_ninfer_ptx", False):
        return

    def create_inline_asm(self, inline_asm, constraints, values, types, is_pure, pack):
        outs = run_ptx(inline_asm, [v.data.view(np.uint32) for v in values], len(types))
        handles = []
        for out, ty in zip(outs, types):
            scalar = ty.scalar if hasattr(ty, "scalar") else ty
            dtype = np.float32 if scalar.is_floating() else np.int32
            handles.append(interpreter.TensorHandle(np.ascontiguousarray(out).view(dtype), scalar))
        return _Results(handles)

    create_inline_asm._ninfer_ptx = True
    builder.create_inline_asm = create_inline_asm
