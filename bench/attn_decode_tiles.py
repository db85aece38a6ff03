"""The 27B decode attention's tiles at the contexts a C=1 MTP round sees, one row and a k=3 verify's four.

s31's C=1 profile had `_decode_kernel` at 16 us a layer for a context of a few hundred tokens, where each program
reads one or two 64-token tiles; the table's tile (BLOCK_N 64, 4 warps, 2 stages) was chosen on an H200 at 64k
tokens. This times each candidate tile (bf16 K/V, 24 q heads over 4 KV heads, D 256, a server-sized pool so the
split count is a server's) with the registers and spills of each compiled variant, and its largest difference
from the table's tile.

    python3 -m bench.attn_decode_tiles --out attn_tiles.json      # a CUDA host
    python3 -m bench.attn_decode_tiles --quick                     # the same code in the interpreter, untimed
    python3 bench/sass_count.py attn:64,4,2 attn:32,4,2            # any host: a tile's registers for sm_90
"""

from __future__ import annotations

import argparse
import json
import os
from functools import partial

import torch

TILES = [(16, 4, 2), (16, 8, 2), (32, 4, 2), (32, 8, 2), (64, 4, 2), (64, 8, 2)]  # BLOCK_N, warps, stages
CONTEXTS = (256, 1024, 8192, 65536)
ROWS = (1, 4)  # a plain C=1 step, a k=3 verify (one decode row per position)
CACHE_SLOTS = 131072


def _rows_batch(rows: int, ctx: int, table: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A verify's rows: the sequence's page-table row repeated, each row one position further."""
    lens = torch.arange(ctx - rows + 1, ctx + 1, dtype=torch.int32, device=device)
    return table.expand(rows, -1).contiguous(), lens


def sweep(device="cuda", contexts=CONTEXTS, rows_list=ROWS, tiles=TILES, cache_slots=CACHE_SLOTS,
          page_size=16, seed=0) -> list[dict]:
    from bench.selfcheck_kv import QWEN27B_ATTN, _timing_cache, _us
    from ninfer.kernels import triton_attention

    hq, hkv, head_dim = QWEN27B_ATTN["hq"], QWEN27B_ATTN["hkv"], QWEN27B_ATTN["head_dim"]
    gen = torch.Generator(device="cuda" if torch.device(device).type == "cuda" else "cpu").manual_seed(seed)
    table = torch.randperm(cache_slots // page_size, generator=gen, device=gen.device).to(device, torch.int32)[None]
    kc, vc, _, _ = _timing_cache("bf16", cache_slots, hkv, head_dim, device, gen)
    records = []
    for rows in rows_list:
        q = torch.randn((rows, hq, head_dim), generator=gen, device=gen.device).to(device, torch.bfloat16)
        for ctx in contexts:
            ctx = min(ctx, cache_slots)
            pages, lens = _rows_batch(rows, ctx, table[:, : -(-ctx // page_size)], device)
            run = partial(triton_attention.paged_decode, q, kc, vc, pages, lens, page_size, head_dim**-0.5)
            base = run()
            rec = {"rows": rows, "context": ctx, "table_us": _us(run, device), "tiles": {}}
            for t in tiles:
                err = (run(tiles=t).float() - base.float()).abs().max().item()
                rec["tiles"]["/".join(map(str, t))] = {"us": _us(partial(run, tiles=t), device), "max_abs_diff": err}
            records.append(rec)
            print(json.dumps(rec), flush=True)
    if torch.device(device).type == "cuda":
        records.append({"kernels": _compiled_tiles(triton_attention._decode_kernel)})
        print(json.dumps(records[-1]), flush=True)
    return records


def _compiled_tiles(kernel) -> list[dict]:
    """Each compiled variant's tile with its registers and spills a thread, as the device's ptxas built them."""
    from bench.selfcheck_nvfp4 import _compiled, compiled_constants

    out = []
    for ck in _compiled(kernel).values():
        consts = compiled_constants(ck)
        out.append({"tile": f"{consts.get('BLOCK_N')}/{ck.metadata.num_warps}/{ck.metadata.num_stages}",
                    "split": consts.get("STORE_LSE"), "regs": getattr(ck, "n_regs", None),
                    "spills": getattr(ck, "n_spills", None)})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes in the interpreter, untimed (a CPU)")
    ap.add_argument("--out", help="write the records here as JSON")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.quick
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        records = sweep("cpu", contexts=(40,), tiles=TILES[:1], cache_slots=128)
    else:
        records = sweep()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
