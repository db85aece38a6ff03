import torch, triton, itertools
from ninfer.kernels import triton_attention as ta
from ninfer.kernels.attention import quantize_kv
torch.manual_seed(0)
dev = "cuda"; ps = 16; LOG2E = ta.LOG2E
hq, hkv, d = 24, 4, 256
S = 65536
kb = torch.randn(S, hkv, d, device=dev, dtype=torch.bfloat16); vb = torch.randn_like(kb)
caches = {"bf16": (kb, vb, None, None)}
for name, st in (("fp8", torch.float8_e4m3fn), ("int8", torch.int8)):
    kq, ks = quantize_kv(kb, st); vq, vs = quantize_kv(vb, st)
    caches[name] = (kq, vq, ks, vs)

def decode(q, kc, vc, ksc, vsc, pt, sl, bn, warps, stages, splits):
    batch = q.shape[0]
    ks_, vs_, *sst, quant = ta._scale_args(kc, ksc, vsc)
    part = torch.empty((batch, hq, splits, d), dtype=torch.float32, device=dev)
    lse = torch.empty((batch, hq, splits), dtype=torch.float32, device=dev)
    out = torch.empty_like(q)
    def run():
        ta._decode_kernel[(batch, hkv, splits)](q, kc, vc, ks_, vs_, pt, sl, part, lse, d ** -0.5 * LOG2E, splits,
            q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), *sst, pt.stride(0),
            part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1), GROUP=hq // hkv, BLOCK_H=16,
            HEAD_DIM=d, BLOCK_D=d, BLOCK_N=bn, PAGE_SIZE=ps, STORE_LSE=True, IEEE=False, KV_QUANT=quant,
            num_warps=warps, num_stages=stages)
        ta._combine_kernel[(batch, hq)](part, lse, out, splits, part.stride(0), part.stride(1), part.stride(2),
            lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), HEAD_DIM=d, BLOCK_D=d, BLOCK_S=64, num_warps=4)
    return triton.testing.do_bench(run, warmup=10, rep=40)

for batch, ctx in ((8, 8192), (1, 65536)):
    q = torch.randn(batch, hq, d, device=dev, dtype=torch.bfloat16)
    pt = torch.arange(S // ps, device=dev, dtype=torch.int32)[: batch * ctx // ps].view(batch, -1)
    sl = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    for name, (kc, vc, ksc, vsc) in caches.items():
        row = []
        for bn, warps, stages in [(32, 8, 2), (64, 8, 2), (64, 4, 2), (128, 4, 3)]:
            try:
                row.append(f"{bn}/{warps}/{stages}:{decode(q, kc, vc, ksc, vsc, pt, sl, bn, warps, stages, 64)*1e3:.0f}")
            except Exception as e:
                row.append(f"{bn}/{warps}/{stages}:ERR {type(e).__name__}")
        print(f"decode B={batch} ctx={ctx} {name}: " + " ".join(row), flush=True)

qlen, cached = 1024, 4096
qp = torch.randn(qlen, hq, d, device=dev, dtype=torch.bfloat16)
qsl = torch.tensor([0, qlen], device=dev, dtype=torch.int32); slp = torch.tensor([cached + qlen], device=dev, dtype=torch.int32)
ptp = torch.arange((cached + qlen) // ps, device=dev, dtype=torch.int32)[None]
for name, (kc, vc, ksc, vsc) in caches.items():
    ks_, vs_, *sst, quant = ta._scale_args(kc, ksc, vsc)
    out = torch.empty_like(qp)
    row = []
    for bm, bn, warps, stages in [(64, 32, 8, 2), (128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2)]:
        def run():
            ta._prefill_kernel[(qlen // bm, 1, hq)](qp, kc, vc, ks_, vs_, out, qsl, slp, ptp, d ** -0.5 * LOG2E,
                qp.stride(0), qp.stride(1), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), *sst,
                out.stride(0), out.stride(1), ptp.stride(0), GROUP=hq // hkv, HEAD_DIM=d, BLOCK_D=d, BLOCK_M=bm,
                BLOCK_N=bn, PAGE_SIZE=ps, IEEE=False, KV_QUANT=quant, num_warps=warps, num_stages=stages)
        try:
            row.append(f"{bm}/{bn}/{warps}/{stages}:{triton.testing.do_bench(run, warmup=5, rep=30)*1e3:.0f}")
        except Exception as e:
            row.append(f"{bm}/{bn}/{warps}/{stages}:ERR {type(e).__name__}")
    print(f"prefill 1024 after 4096 {name}: " + " ".join(row), flush=True)
