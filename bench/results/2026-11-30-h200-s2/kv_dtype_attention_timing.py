import torch, triton
from ninfer.kernels import triton_attention as ta
from ninfer.kernels.attention import quantize_kv
from ninfer.models.batch import ForwardBatch
torch.manual_seed(0)
dev = "cuda"
for (batch, ctx, hq, hkv, d) in [(8, 8192, 24, 4, 256), (1, 65536, 24, 4, 256), (8, 2048, 16, 2, 128)]:
    ps = 16
    pages = batch * ctx // ps
    S = pages * ps
    k = torch.randn(S, hkv, d, device=dev, dtype=torch.bfloat16); v = torch.randn_like(k)
    q = torch.randn(batch, hq, d, device=dev, dtype=torch.bfloat16)
    pt = torch.arange(pages, device=dev, dtype=torch.int32).view(batch, -1)
    sl = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    res = {}
    ms = triton.testing.do_bench(lambda: ta.paged_decode(q, k, v, pt, sl, ps, d ** -0.5))
    res["bf16"] = ms
    for st in (torch.float8_e4m3fn, torch.int8):
        kq, ks = quantize_kv(k, st); vq, vs = quantize_kv(v, st)
        res[str(st).split(".")[-1]] = triton.testing.do_bench(lambda: ta.paged_decode(q, kq, vq, pt, sl, ps, d ** -0.5, k_scale=ks, v_scale=vs))
    kvbytes = 2 * batch * ctx * hkv * d * 2
    print(f"decode B={batch} ctx={ctx} hq={hq} hkv={hkv} d={d}: " + ", ".join(f"{n} {t*1e3:.1f} us" for n, t in res.items()) + f"  (bf16 KV {kvbytes/res['bf16']/1e9:.0f} GB/s)")
    # prefill chunk of 1024 after 4096 cached, one sequence
    qlen, cached = 1024, 4096
    qp = torch.randn(qlen, hq, d, device=dev, dtype=torch.bfloat16)
    qsl = torch.tensor([0, qlen], device=dev, dtype=torch.int32); slp = torch.tensor([cached + qlen], device=dev, dtype=torch.int32)
    ptp = torch.arange((cached + qlen) // ps, device=dev, dtype=torch.int32)[None]
    out = {"bf16": triton.testing.do_bench(lambda: ta.paged_prefill(qp, k, v, qsl, slp, ptp, ps, d ** -0.5, qlen))}
    for st in (torch.float8_e4m3fn, torch.int8):
        kq, ks = quantize_kv(k, st); vq, vs = quantize_kv(v, st)
        out[str(st).split(".")[-1]] = triton.testing.do_bench(lambda: ta.paged_prefill(qp, kq, vq, qsl, slp, ptp, ps, d ** -0.5, qlen, k_scale=ks, v_scale=vs))
    print(f"  prefill 1024 after 4096: " + ", ".join(f"{n} {t*1e3:.0f} us" for n, t in out.items()))
    for T in (8, 1024):
        kn = torch.randn(T, hkv, d, device=dev, dtype=torch.bfloat16); vn = torch.randn_like(kn)
        slots = torch.randperm(S, device=dev)[:T]
        kc = torch.empty(S, hkv, d, device=dev, dtype=torch.float8_e4m3fn); vc = torch.empty_like(kc)
        ksc = torch.empty(S, hkv, device=dev); vsc = torch.empty_like(ksc)
        t = triton.testing.do_bench(lambda: ta.write_kv_quantized(kc, vc, ksc, vsc, kn, vn, slots))
        kb, vb = torch.empty(S, hkv, d, device=dev, dtype=torch.bfloat16), torch.empty(S, hkv, d, device=dev, dtype=torch.bfloat16)
        t0 = triton.testing.do_bench(lambda: (kb.index_copy_(0, slots, kn), vb.index_copy_(0, slots, vn)))
        print(f"  write {T} tokens: fp8 quantizing write {t*1e3:.1f} us, bf16 index_copy_ x2 {t0*1e3:.1f} us")
