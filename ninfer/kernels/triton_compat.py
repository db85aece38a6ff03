"""Run our Triton kernels under Triton's CPU interpreter (`TRITON_INTERPRET=1`) with NumPy >= 2.4,
with inline PTX emulated and bf16 rounding as on the GPU (see the functions below).

The interpreter keeps every scalar as a 1-element NumPy array and converts it to a Python int
with `int(array)` when a runtime value bounds a loop (`for blk in range(lo, hi)`). NumPy 2.4 made
that conversion a TypeError ("only 0-dimensional arrays can be converted to Python scalars";
triton-lang/triton#9171), so every kernel with a data-dependent loop bound fails in Triton <= 3.6's
interpreter. Rewriting the loops (e.g. as `while`) would cost the compiled kernels their software
pipelining, so instead `fix_interpreter()` wraps the interpreter's tensor patching to take the
scalar with `.item()`. It does nothing unless TRITON_INTERPRET=1 and the interpreter has the hook
it wraps; the compiled (GPU) path is untouched.
"""

from __future__ import annotations

import os


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET set on)."""
    return os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "on")


def fix_interpreter() -> None:
    if not interpreting():
        return
    try:
        from triton.runtime import interpreter
    except Exception:  # no interpreter in this triton build: nothing to fix
        return
    from ninfer.kernels.ptx_emulator import install_interpreter_inline_asm

    install_interpreter_inline_asm()  # inline PTX (the packed-fp16 NVFP4 GEMV) through the CPU emulator
    _round_bf16_to_nearest_even(interpreter)
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_ninfer_index_fix", False):
        return

    def _index(self):
        return int(self.handle.data.item())  # a 1-element array; raises for a real block, as before

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _index)  # restored with the rest when the kernel returns

    patch_lang_tensor._ninfer_index_fix = True
    interpreter._patch_lang_tensor = patch_lang_tensor


def _round_bf16_to_nearest_even(interpreter) -> None:
    """The interpreter's fp32 -> bf16 `.to()` truncates the mantissa, where compiled Triton (and
    torch) round to nearest even: kernels that round intermediates to bf16 then drift from their
    references by a bias of ~2^-9 per rounding. Round like the GPU does."""
    import numpy as np
    import torch
    import triton.language as tl

    builder = interpreter.InterpreterBuilder
    original = builder.cast_impl
    if getattr(original, "_ninfer_rtne", False):
        return

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            values = torch.from_numpy(np.ascontiguousarray(src.data).view(np.float32))
            return interpreter.TensorHandle(values.to(torch.bfloat16).view(torch.uint16).numpy(), tl.bfloat16)
        return original(self, src, dst_type)

    cast_impl._ninfer_rtne = True
    builder.cast_impl = cast_impl
