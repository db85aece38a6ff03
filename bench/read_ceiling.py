"""How fast can the 27B's NVFP4 linears be read at all? Per linear shape, beside the mma GEMV that serves them:

- `rows`: the GEMV's own loads (each lane's rows g and g + 8 of its 16-row tiles, 16 bytes of paired codes and 2
  scale bytes a load, one program a tile, 8 warps) with no mma and no x: what the GEMV's access pattern costs alone;
- `flat`: the same bytes stored contiguously per program (the layout a tile-interleaved, Marlin-style storage
  would give), read 16 bytes a lane with the GEMV's grid, then with grids of 1, 2, 4 and 8 programs an SM.

If `rows` is near the GEMV, its time goes to memory, not to decoding; if `flat` is well under `rows`, storing each
tile's weights contiguously would pay; if all three meet, the linears are at the card's read speed and only fewer
bytes would help. Every timing is 20 calls in one CUDA graph, rotating over copies of the weight that outgrow L2
(bench.selfcheck_nvfp4's timing). Prints one JSON line.

    python -m bench.read_ceiling [--shapes mlp_down o_proj] [--out FILE]
    python -m bench.read_ceiling --check   # the readers against torch on small shapes (the CPU interpreter too)
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from ninfer.kernels.triton_nvfp4_mma import _load_w, _tile_rows

WARPS = 8
FLAT_BLOCK = 32 * WARPS * 4  # int32 words a flat-reader iteration takes: 16 bytes a lane


@triton.jit
def _rows_read_kernel(W32, S8, OUT, N, KW: tl.constexpr, TILES: tl.constexpr, WARPS: tl.constexpr,
                      UNROLL: tl.constexpr):
    """The paired mma GEMV's weight loads (as triton_nvfp4_mma._gemv_mma_kernel makes them), XORed together."""
    LANES: tl.constexpr = 32 * WARPS
    KB: tl.constexpr = KW // 2
    SB: tl.constexpr = 4 * WARPS
    LOADS: tl.constexpr = KB // SB // 2
    idx = tl.arange(0, LANES)
    lane = idx % 32
    wblk = 2 * ((idx // 32) * 4 + lane % 4)
    pid = tl.program_id(0)
    wrows, srows = _tile_rows(W32, S8, pid * (16 * TILES), N, KW, KB, lane // 4, TILES, True)
    acc = tl.zeros([LANES], dtype=tl.int32)
    for q in tl.range(0, LOADS, loop_unroll_factor=UNROLL):
        ws = _load_w(wrows, srows, wblk + q * 2 * SB, True, 0)
        for v in tl.static_range(len(ws)):
            acc = acc ^ ws[v]
    tl.store(OUT + pid * LANES + idx, acc)


@triton.jit
def _flat_read_kernel(SRC, OUT, total, PER_PROG, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """Program p reads int32 words [p PER_PROG, (p + 1) PER_PROG) of SRC (total words), BLOCK at a time, XORed."""
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * PER_PROG
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in tl.range(0, PER_PROG // BLOCK, loop_unroll_factor=UNROLL):
        at = base + i * BLOCK + offs
        acc = acc ^ tl.load(SRC + at, mask=at < total, other=0)
    tl.store(OUT + pid * BLOCK + offs, acc)


def read_rows(words: torch.Tensor, sbytes: torch.Tensor, out: torch.Tensor, *, tiles: int = 1,
              unroll: int = 2) -> None:
    """words [N, K/8] int32 (paired codes), sbytes [N, K/16] uint8; out: N / 16 / tiles * 32 * WARPS int32."""
    n, kw = words.shape
    _rows_read_kernel[(n // (16 * tiles),)](words, sbytes, out, n, KW=kw, TILES=tiles, WARPS=WARPS, UNROLL=unroll,
                                            num_warps=WARPS)


def read_flat(src: torch.Tensor, out: torch.Tensor, programs: int, unroll: int = 4) -> None:
    """src: int32 words, split into `programs` contiguous runs of whole FLAT_BLOCKs; out: programs * FLAT_BLOCK."""
    total = src.numel()
    per_prog = triton.cdiv(triton.cdiv(total, programs), FLAT_BLOCK) * FLAT_BLOCK
    _flat_read_kernel[(programs,)](src, out, total, per_prog, BLOCK=FLAT_BLOCK, UNROLL=unroll,
                                   num_warps=WARPS)


def _xor_fold(v: torch.Tensor) -> int:
    while v.numel() > 1:
        if v.numel() % 2:
            v = torch.cat([v, v.new_zeros(1)])
        v = v[0::2] ^ v[1::2]
    return int(v[0]) if v.numel() else 0


def check(device: str = "cuda") -> dict:
    """Both readers see every byte once: the XOR of their outputs is the XOR of the input's words (int32)."""
    gen = torch.Generator(device="cpu").manual_seed(5)
    n, k = 64, 1024
    words = torch.randint(-2**31, 2**31 - 1, (n, k // 8), generator=gen, dtype=torch.int32).to(device)
    sbytes = torch.randint(0, 256, (n, k // 16), generator=gen, dtype=torch.uint8).to(device)
    out = torch.zeros(n // 16 * 32 * WARPS, dtype=torch.int32, device=device)
    read_rows(words, sbytes, out)
    # a lane's two scale bytes come as one sign-extended int16
    pairs = sbytes.view(torch.int16).to(torch.int64) & 0xFFFFFFFF
    want_rows = _xor_fold(words.reshape(-1).to(torch.int64) & 0xFFFFFFFF) ^ _xor_fold(pairs.reshape(-1))
    got_rows = _xor_fold(out.reshape(-1).to(torch.int64) & 0xFFFFFFFF)
    flat = words.reshape(-1)[: words.numel() - 100]  # a ragged tail
    fout = torch.zeros(3 * FLAT_BLOCK, dtype=torch.int32, device=device)
    read_flat(flat, fout, 3)
    return {"rows": got_rows == want_rows,
            "flat": _xor_fold(fout.to(torch.int64) & 0xFFFFFFFF) == _xor_fold(flat.to(torch.int64) & 0xFFFFFFFF)}


def measure(shapes: dict, iters: int = 20) -> list[dict]:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return [_measure_shape(name, n, k, sms, iters) for name, (n, k) in shapes.items()]


def _measure_shape(name: str, n: int, k: int, sms: int, iters: int) -> dict:
    from bench.selfcheck_nvfp4 import _problem, _rotating, _time
    from ninfer.kernels import triton_nvfp4, triton_nvfp4_mma

    plain, _ = _problem(n, k, 1, "cuda", torch.bfloat16)
    q = (*triton_nvfp4_mma.pair_weights(plain[0], plain[1], WARPS), plain[2])
    nbytes = n * k // 2 + n * k // 16
    copies = max(1, -(-(120 << 20) // nbytes))  # rotate over > 2x the L2
    qs = [q] + [tuple(t.clone() for t in q) for _ in range(copies - 1)]
    flats = [torch.empty(nbytes // 4, dtype=torch.int32, device="cuda").random_() for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(max(n // 16, 8 * sms) * FLAT_BLOCK, dtype=torch.int32, device="cuda")
    row = {"shape": name, "n": n, "k": k, "MB": round(nbytes / 1e6, 2)}

    def put(key, fn, items):
        us = _time(_rotating(fn, items), iters)
        row[key] = {"us": round(us, 2), "GBps": round(nbytes / us / 1e3, 1)}

    put("gemv_m1", lambda qq: triton_nvfp4.nvfp4_gemv(x, *qq, out=y, paired=WARPS), qs)
    for tiles in (1, 2):
        for unroll in (1, 2, 5):
            put(f"rows_t{tiles}_u{unroll}",
                lambda qq, t=tiles, u=unroll: read_rows(triton_nvfp4._words(qq[0]), qq[1].view(torch.uint8), out,
                                                        tiles=t, unroll=u), qs)
    for programs in (n // 16, sms, 2 * sms, 4 * sms, 8 * sms):
        put(f"flat_p{programs}", lambda f, p=programs: read_flat(f, out, p), flats)
    return row


def main(argv=None) -> None:
    from bench.selfcheck_nvfp4 import SHAPES_27B

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES_27B), choices=list(SHAPES_27B))
    parser.add_argument("--check", action="store_true", help="only check the readers against torch")
    parser.add_argument("--out", help="write the JSON here too")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "check": check(device)}
    if not args.check:
        result["shapes"] = measure({s: SHAPES_27B[s] for s in args.shapes})
    line = json.dumps(result)
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
