"""Count the SASS instructions in a Triton kernel's main loop, compiled for sm_90 on a CPU host.

Triton compiles for a GPU target without a GPU (its bundled ptxas and cuobjdump do the rest), so a
kernel's cost per weight can be weighed before spending device time. The loop is the longest
backward branch's body; its instruction count divided by the weights one thread handles per
iteration (for the packed-fp16 kernel, whose K loop is unrolled, both unrolled steps) is the figure
quoted in ninfer/kernels/triton_nvfp4.py.

  python bench/sass_count.py                     # the NVFP4 GEMVs at their table tiles
  python bench/sass_count.py hfma:8,128,2 hfma:4,256,4,2 fma:4,128,4   # [kind:block_n,block_w,warps(,x rows)]
  python bench/sass_count.py mma:1,8 mma:1,8,4,2  # the tensor-core GEMV [mma:16-row tiles,warps(,8-token tiles,depth,unroll,prefetch,stages,paired,evict,tiled)]
  python bench/sass_count.py order:rmsnorm order:recurrent  # a small kernel's loads, stores and barriers in order
  python bench/sass_count.py attn:64,4,2 attn:32,4,2   # the paged decode attention [attn:block_n,warps,stages]
  SASS_TOP=40 python bench/sass_count.py ...      # more of the loop's opcodes
Prints one JSON line per kernel: registers, loop instructions, its loads by width, instructions per weight,
top opcodes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
import triton.backends.nvidia as nvidia_backend  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

CUOBJDUMP = os.path.join(os.path.dirname(nvidia_backend.__file__), "bin", "cuobjdump")
_ADDR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)")


def _compile(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int = 1) -> tuple[str, str]:
    """(resource usage, SASS) of the kernel compiled for sm_90."""
    # as the JIT specialises a launch at the 27B shapes: every pointer 16-byte aligned and every
    # integer argument a multiple of 16 (what lets Triton vectorise loads)
    names = list(signature)
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, v in signature.items() if v != "constexpr"}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True).stdout
    return usage, sass


def memory_order(fn, signature: dict, constexprs: dict, num_warps: int) -> str:
    """The kernel's global loads (LDG), stores (STG) and barriers (BAR) in SASS order, runs collapsed: 'LDGx44 BARx15
    STGx33'. A load after a barrier or a store waits for it: one memory round trip more in a latency-bound kernel."""
    ops = [m.group(1) for line in _compile(fn, signature, constexprs, num_warps)[1].splitlines()
           if (m := re.search(r"\b(LDG|STG|BAR)\b", line))]
    runs = []
    for op in ops:
        if runs and runs[-1][0] == op:
            runs[-1][1] += 1
        else:
            runs.append([op, 1])
    return " ".join(f"{op}x{n}" for op, n in runs)


def small_kernel(name: str) -> dict:
    """A decode step's small kernels at the 27B shapes, by name: `rmsnorm` (residual add + RMSNorm, 5120 wide) or
    `recurrent` (the GDN recurrent step on raw gate projections as two split-K partial sums), `recurrent_steps` and
    `conv_steps` (a C=1 k=3 verify's four GDN positions in one launch): their memory order."""
    from ninfer.kernels import triton_fused, triton_gdn

    def sig_of(fn, types: dict) -> dict:
        return {n: types.get(n) or ("i64" if n.startswith("stride") else "constexpr") for n in fn.arg_names}

    if name == "rmsnorm":
        fn = triton_fused._fused_rmsnorm_kernel
        sig = sig_of(fn, {**dict.fromkeys(("X", "H", "W", "RES", "Y"), "*bf16"), "N": "i32", "eps": "fp32"})
        const = {"HAS_ADD": True, "ZERO_CENTERED": True, "BLOCK": 8192, "USE_PDL": False}
        warps = triton_fused._norm_warps(8192)
    elif name == "conv_steps":
        fn = triton_gdn._conv_steps_kernel
        sig = sig_of(fn, {**dict.fromkeys(("X", "W", "S", "Y"), "*bf16"), "C": "i32", "B": "i32",
                          **dict.fromkeys(("SLOT_IN", "SLOT_OUT"), "*i64")})
        const = {"STEPS": 4, "WIDTH": 3, "BLOCK_W": 4, "BLOCK_C": 256, "USE_PDL": False}
        warps = 4
    else:
        steps = name == "recurrent_steps"
        fn = triton_gdn._recurrent_steps_kernel if steps else triton_gdn._recurrent_kernel
        sig = sig_of(fn, {**dict.fromkeys(("Q", "K", "V", "OP"), "*bf16"), "scale": "fp32", "B": "i32",
                          **dict.fromkeys(("G", "BETA", "A_LOG", "DT_BIAS", "H", "H_IN", "H_OUT"), "*fp32"),
                          **dict.fromkeys(("SLOT_IN", "SLOT_OUT", "HAS_INIT"), "*i64")})
        const = {"HK": 16, "HV": 48, "DK": 128, "DV": 128, "BK": 128, "BV": 32, "L2NORM": True, "RAW_GATES": True,
                 "SPLIT": 2, "USE_PDL": False, **({"STEPS": 4} if steps else {"USE_INIT_MASK": True})}
        warps = 4
    return {"kernel": name, "num_warps": warps, "memory_order": memory_order(fn, sig, const, warps)}


def loop_profile(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int = 1) -> dict:
    usage, sass = _compile(fn, signature, constexprs, num_warps, num_stages)
    instrs = [(int(m.group(1), 16), m.group(2), line) for line in sass.splitlines() if (m := _ADDR.match(line))]
    loop = (0, 0)
    for addr, op, line in instrs:  # the longest backward branch is the main loop
        target = re.search(r"BRA\s.*?0x([0-9a-f]+)", line)
        if op.startswith("BRA") and target and int(target.group(1), 16) < addr:
            start = int(target.group(1), 16)
            loop = max(loop, (start, addr), key=lambda span: span[1] - span[0])
    body = [op.split(".")[0] for addr, op, _ in instrs if loop[0] <= addr <= loop[1]]
    regs = re.search(r"REG:(\d+)", usage)
    local = re.search(r"STACK:(\d+)", usage)  # bytes of stack frame: register spills
    return {"registers": int(regs.group(1)) if regs else None, "local_bytes": int(local.group(1)) if local else None,
            "loop_instructions": len(body),
            "loads": dict(Counter(op for addr, op, _ in instrs if loop[0] <= addr <= loop[1] and op.startswith("LD"))),
            "top_ops": Counter(body).most_common(int(os.environ.get("SASS_TOP", "8")))}


def nvfp4(kind: str, block_n: int, block_w: int, num_warps: int, x_rows: int = 1) -> dict:
    from ninfer.kernels import triton_nvfp4 as t

    common = {"W": "*i32", "S": "*u8", "RS": "*fp32", "Y": "*bf16", "N": "i32", "KW": "i32",
              "stride_wn": "i32", "stride_sn": "i32", "BLOCK_N": "constexpr", "BLOCK_W": "constexpr"}
    if kind == "hfma":
        sig = {"X32": "*i32", "W": "*i32", "S": "*u8", "RS": "*fp32", "Y": "*bf16", "N": "i32", "stride_x32": "i32",
               "stride_ym": "i32", "KW": "constexpr", "BLOCK_N": "constexpr", "BLOCK_W": "constexpr",
               "EVEN_N": "constexpr", "X_ROWS": "constexpr", "XR": "constexpr", "USE_PDL": "constexpr",
               "PREFETCH": "constexpr"}
        const = {"KW": 768, "BLOCK_N": block_n, "BLOCK_W": block_w, "EVEN_N": True, "X_ROWS": x_rows,
                 "XR": 1 << (x_rows - 1).bit_length(), "USE_PDL": False, "PREFETCH": 0}  # KW: K = 6144 (27B o_proj), whole steps for every tile
        out = loop_profile(t._gemv_hfma_kernel, sig, const, num_warps)
    else:
        sig = {"X": "*bf16", **common, "M": "i32", "stride_xm": "i32", "stride_ym": "i32", "BLOCK_M": "constexpr"}
        sig = {k: sig[k] for k in ("X", "W", "S", "RS", "Y", "M", "N", "KW", "stride_xm", "stride_wn", "stride_sn",
                                   "stride_ym", "BLOCK_M", "BLOCK_N", "BLOCK_W")}
        out = loop_profile(t._gemv_fma_kernel, sig, {"BLOCK_M": 1, "BLOCK_N": block_n, "BLOCK_W": block_w}, num_warps)
    # one int32 word = 8 weights; the hfma loop body holds HFMA_UNROLL steps
    weights_per_thread = block_n * block_w * 8 / (32 * num_warps) * (t.HFMA_UNROLL.value if kind == "hfma" else 1)
    return {"kernel": f"nvfp4_{kind}", "block_n": block_n, "block_w": block_w, "num_warps": num_warps,
            "x_rows": x_rows, **out,
            "instructions_per_weight": round(out["loop_instructions"] / weights_per_thread, 2)}


def nvfp4_mma(tiles: int, warps: int, token_tiles: int = 1, depth: int = 0, unroll: int = 0, prefetch: int = 0,
              stages: int = 0, paired: int = 0, evict: int = 0, tiled: int = 0) -> dict:
    """The tensor-core GEMV (triton_nvfp4_mma) at K = 17408 (27B MLP down; shorter rows leave so few steps that
    the loop is unrolled whole) for `token_tiles` tiles of 8 rows of x, `depth` steps of weights ahead, its K
    loop unrolled `unroll` times (0: as gemv_mma launches) and an L2 prefetch `prefetch` steps past them, or
    `stages` steps staged through shared memory instead; `paired`: the weights stored paired (two steps a load;
    depth then counts pairs); `tiled`: paired and tiled (each 16-row tile one run)."""
    from ninfer.kernels import triton_nvfp4_mma as t

    kw = 2176  # the kernel's KW: K = 17408 (27B MLP down) in words of 8 codes
    sig = {"X32": "*i32", "W32": "*i32", "S8": "*u8", "RS": "*fp32", "Y": "*bf16", "M": "i32", "N": "i32",
           "stride_x32": "i32", "stride_ym": "i32", "KW": "constexpr", "TILES": "constexpr",
           "WARPS": "constexpr", "EVEN_N": "constexpr", "XT": "constexpr", "DEPTH": "constexpr", "UNROLL": "constexpr",
           "USE_PDL": "constexpr", "PREFETCH": "constexpr", "STAGES": "constexpr", "PAIRED": "constexpr",
           "EVICT": "constexpr", "W_ROW": "constexpr", "S_ROW": "constexpr", "TILED": "constexpr"}
    per_load = 2 if paired else 1  # steps a weight load covers
    depth = depth or -(-t.default_depth(token_tiles, 8 * kw) // per_load)
    unroll = unroll or (1 if stages else depth)
    const = {"KW": kw, "TILES": tiles, "WARPS": warps, "EVEN_N": True, "XT": token_tiles,
             "DEPTH": depth, "UNROLL": unroll, "USE_PDL": False, "PREFETCH": prefetch, "STAGES": stages,
             "PAIRED": bool(paired), "EVICT": evict, "W_ROW": 0, "S_ROW": 0, "TILED": bool(tiled)}
    out = loop_profile(t._gemv_mma_kernel, sig, const, warps, num_stages=max(stages, 1))
    weights_per_thread = 16 * tiles * t.K_STEP / 32 * unroll * per_load  # a step: 1/32 of 16 rows x 64 codes a tile
    return {"kernel": "nvfp4_mma", "tiles": tiles, "num_warps": warps, "token_tiles": token_tiles,
            "depth": const["DEPTH"], "unroll": unroll, "prefetch": prefetch, "stages": stages,
            "paired": bool(paired), "tiled": bool(tiled), **out,
            "instructions_per_weight": round(out["loop_instructions"] / weights_per_thread, 2)}


def attention(block_n: int, warps: int, stages: int) -> dict:
    """The paged decode attention (triton_attention._decode_kernel) at the 27B head shape (24 q heads over 4 KV
    heads, D 256), bf16 K/V, the split path with PDL, as a served decode launches it, at one tile."""
    from ninfer.kernels import triton_attention as t

    group, head_dim = 6, 256
    ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "KS": "*bf16", "VS": "*bf16", "PT": "*i32", "SL": "*i32",
            "OP": "*fp32", "LSE": "*fp32", "qk_scale": "fp32"}
    const = {"GROUP": group, "BLOCK_H": 16, "HEAD_DIM": head_dim, "BLOCK_D": head_dim, "BLOCK_N": block_n,
             "PAGE_SIZE": 16, "STORE_LSE": True, "IEEE": False, "KV_QUANT": False, "USE_PDL": True, "K_FP4": False,
             "V_FP4": False, "HALF_D": head_dim // 2, "BLOCK_J": head_dim // 2}
    sig = {n: ptrs.get(n) or ("constexpr" if n in const else "i32") for n in t._decode_kernel.arg_names}
    out = loop_profile(t._decode_kernel, sig, const, warps, num_stages=stages)
    return {"kernel": "paged_decode", "block_n": block_n, "num_warps": warps, "num_stages": stages, **out}


def main(argv: list[str]) -> None:
    specs = argv or ["hfma:8,128,2", "hfma:16,64,1", "hfma:8,128,2,2", "hfma:8,128,2,4", "fma:8,64,2", "fma:4,128,4"]
    for spec in specs:
        kind, dims = spec.split(":")
        if kind == "order":
            print(json.dumps(small_kernel(dims)), flush=True)
            continue
        args = [int(v) for v in dims.split(",")]
        run = {"mma": nvfp4_mma, "attn": attention}.get(kind)
        print(json.dumps(run(*args) if run else nvfp4(kind, *args)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
