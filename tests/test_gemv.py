"""Decode skinny GEMM (ninfer.kernels.triton_gemv) and the DecodeLinear swap (ninfer.kernels.linear).

- With `triton` and TRITON_INTERPRET=1 (conftest sets it on CPU): the kernel on fp32 CPU tensors
  against F.linear, for M in {1, 2, 5, 16}, odd N and K, both inner products (CUDA-core FMA and
  tensor-core dot), with and without split-K, with a bias; split-K results identical run to run.
- Always (CPU): DecodeLinear keeps nn.Linear's state-dict names and storage; use_decode_linears_
  swaps only exact nn.Linear modules, is idempotent and leaves a CPU model's outputs bit-identical
  (CPU tensors take F.linear); NINFER_GEMV=cublas and CPU tensors route to F.linear.
- With a CUDA device (marker `cuda`): bf16 against cuBLAS and the decode step's routing.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_markers import needs_cuda, needs_interpreter
from torch import nn

from ninfer.kernels import linear as lin


def _problem(m, n, k, bias, seed, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((m, k), generator=g).to(device=device, dtype=dtype)
    w = (torch.randn((n, k), generator=g) * k**-0.5).to(device=device, dtype=dtype)
    b = torch.randn((n,), generator=g).to(device=device, dtype=dtype) if bias else None
    return x, w, b


# ---- the kernel in Triton's interpreter (fp32) ----------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("path", ["fma", "fma_split", "dot", "heuristic"])
@pytest.mark.parametrize("like", [1, 2, 3])
@pytest.mark.parametrize("programs", ["one_block_each", "grouped", "all_blocks"])
def test_rows_like_computes_every_row_as_the_smaller_product_in_interpreter(path, like, programs, monkeypatch):
    """Speculative verification (issue 21): with rows_like=B, a product of B*w rows (up to 64, past the plain
    kernel's 16) gives each row exactly what the B-row product of its own group gives: same config, same
    row block; row blocks as programs of their own (NINFER_GEMV_ROWS=0), or with MULTI_ROW_FMA (the
    default) several per CUDA-core program (all of them, or with a smaller register budget groups, the last partly past the rows)."""
    from ninfer.kernels import triton_gemv
    from ninfer.kernels.triton_gemv import gemv

    monkeypatch.setattr(triton_gemv, "MULTI_ROW_FMA", programs != "one_block_each")
    monkeypatch.setattr(triton_gemv, "ROWS_ACC_REGISTERS", 32 if programs == "grouped" else 128)

    x, w, b = _problem(like * 5, 33, 70, True, seed=like)
    cfg = _configs()[path]
    together = gemv(x, w, b, config=cfg, rows_like=like)
    alone = torch.cat([gemv(x[i: i + like], w, b, config=cfg) for i in range(0, x.shape[0], like)])
    assert torch.equal(together, alone)
    big = _problem(48, 17, 40, False, seed=9)[0]
    assert gemv(big, _problem(1, 17, 40, False, seed=9)[1], rows_like=8).shape == (48, 17)




def _configs():
    from ninfer.kernels.triton_gemv import GemvConfig

    return {
        "fma": GemvConfig(dot=False, block_n=8, block_k=64),
        "fma_split": GemvConfig(dot=False, block_n=4, block_k=32, split_k=3),
        "dot": GemvConfig(dot=True, block_n=16, block_k=32),
        "dot_split": GemvConfig(dot=True, block_n=32, block_k=32, split_k=4, num_stages=3),
        "heuristic": None,
    }


@needs_interpreter
@pytest.mark.parametrize("path", ["fma", "fma_split", "dot", "dot_split", "heuristic"])
def test_kernel_matches_f_linear_in_interpreter(path):
    from ninfer.kernels.triton_gemv import gemv

    cfg = _configs()[path]
    shapes = [(37, 101, True), (64, 256, False), (130, 96, True)]  # N, K (odd, one not a tile multiple)
    for m in (1, 2, 5, 16):
        for i, (n, k, bias) in enumerate(shapes):
            x, w, b = _problem(m, n, k, bias, seed=10 * m + i)
            got = gemv(x, w, b, config=cfg)
            ref = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
            assert got.shape == (m, n) and got.dtype == x.dtype
            assert (got - ref).abs().max().item() < 1e-4, (path, m, n, k)


@needs_interpreter
def test_kernel_leading_dims_strided_x_and_split_determinism():
    from ninfer.kernels.triton_gemv import GemvConfig, gemv

    g = torch.Generator().manual_seed(3)
    base = torch.randn((2, 3, 200), generator=g)
    x = base[..., :150]  # [2, 3, 150], rows strided
    w = torch.randn((70, 150), generator=g) * 150**-0.5
    cfg = GemvConfig(dot=False, block_n=8, block_k=32, split_k=2)
    a, b = gemv(x, w, config=cfg), gemv(x, w, config=cfg)
    assert a.shape == (2, 3, 70)
    assert torch.equal(a, b)
    assert torch.allclose(a, F.linear(x, w), atol=1e-5, rtol=0)


def test_config_table_shapes():
    """The heuristic on the 27B shapes and tiny ones: legal tiles, no empty split pieces."""
    pytest.importorskip("triton")
    from bench.selfcheck_gemv import SHAPES_27B
    from ninfer.kernels import triton_gemv as tg

    shapes = [(n, k) for n, k, _ in SHAPES_27B.values()] + [(64, 64), (1000, 999), (33, 1024), (5, 70)]
    for n, k in shapes:
        for m in range(1, 17):
            for dtype in (torch.bfloat16, torch.float32):
                cfg = tg.pick_config(m, n, k, torch.device("cpu"), dtype)
                assert cfg.split_k >= 1 and cfg.block_k >= 16
                assert cfg.block_n >= (16 if cfg.dot else 1)
                assert cfg.dot or m <= 4, (m, cfg)
                assert cfg.block_k <= max(16, triton_next_pow2(k))


def triton_next_pow2(v: int) -> int:
    return 1 << (v - 1).bit_length()


# ---- DecodeLinear and the swap (CPU) ----------------------------------------------------------------


class _Quant(nn.Linear):  # stands in for another linear subclass (e.g. a quantized one)
    pass


def _toy():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 20), nn.GELU(), _Quant(20, 16, bias=False), nn.Linear(16, 5, bias=False))


def test_decode_linear_keeps_names_and_storage():
    model = _toy()
    before = {k: (v.data_ptr(), v.shape) for k, v in model.state_dict().items()}
    params = [id(p) for p in model.parameters()]
    assert lin.use_decode_linears_(model) == 2
    assert type(model[0]) is lin.DecodeLinear and type(model[3]) is lin.DecodeLinear
    assert type(model[2]) is _Quant  # subclasses are left alone
    after = {k: (v.data_ptr(), v.shape) for k, v in model.state_dict().items()}
    assert after == before
    assert [id(p) for p in model.parameters()] == params
    assert lin.use_decode_linears_(model) == 0  # idempotent
    model.load_state_dict(_toy().state_dict())  # the same names load back


def test_swap_keeps_cpu_outputs_bit_identical(monkeypatch):
    monkeypatch.delenv(lin.ENV_VAR, raising=False)
    model = _toy()
    x = torch.randn(3, 12)
    ref = model(x)
    lin.use_decode_linears_(model)
    assert torch.equal(model(x), ref)
    bf = torch.randn(2, 12, dtype=torch.bfloat16)
    assert not lin.takes_gemv(bf, model[0].weight.to(torch.bfloat16))  # CPU: F.linear


def test_qwen_model_outputs_bit_identical_after_swap():
    from ninfer.forward import ForwardBatch, ModelCache
    from ninfer.kernels.linear import use_decode_linears_
    from ninfer.models.qwen3_5 import QWEN3_6_SHAPES, Qwen3_5ForCausalLM

    cfg = dict(QWEN3_6_SHAPES["tiny-qwen3.6"], vocab_size=256)
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(cfg).eval()
    model.init_random_(seed=1)
    unfused = model.state_dict()
    model.fuse_projections_()
    storage = {p.data_ptr() for p in model.parameters()}

    def run(m):
        cache = ModelCache(m.cache_spec(), 8, 16, 2, torch.float32)
        batch = ForwardBatch.build([[1, 5, 9, 4, 2]], [0], [[0, 1]], 16, state_slots=[0])
        with torch.no_grad():
            return m.compute_logits(m(batch, cache))

    ref = run(model)
    n = use_decode_linears_(model)
    assert n > 0 and use_decode_linears_(model) == 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert torch.equal(run(model), ref)
    assert {p.data_ptr() for p in model.parameters()} == storage  # no copies
    # checkpoint names survive the fusion and the swap: state dict out, and back in
    sd = model.state_dict()
    assert set(sd) == set(unfused)
    assert all(torch.equal(sd[k], unfused[k]) for k in sd)
    fresh = Qwen3_5ForCausalLM(cfg).eval()
    fresh.fuse_projections_()
    use_decode_linears_(fresh)
    fresh.load_state_dict(unfused)
    assert torch.equal(run(fresh), ref)


def test_cublas_env_and_cpu_route_to_f_linear(monkeypatch):
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    w = torch.randn(4, 8, dtype=torch.bfloat16)
    monkeypatch.setenv(lin.ENV_VAR, "cublas")
    assert lin.cublas_forced() and not lin.takes_gemv(x, w)
    assert torch.equal(lin.linear(x, w), F.linear(x, w))
    monkeypatch.delenv(lin.ENV_VAR)
    assert not lin.cublas_forced()
    assert not lin.takes_gemv(x, w)  # CPU tensors


@pytest.mark.parametrize("like", [1, 2, 3])
def test_rows_like_on_the_cpu_computes_each_position_as_the_plain_steps_product(like):
    """Exact verification on the CPU (float32, F.linear): inside rows_like(B), `linear` over B sequences' verify
    rows (sequence-major, w positions each) gives every row what the plain decode step's product of those B
    sequences' rows gives, bit for bit (one product of all B*w rows rounds differently on the CPU: s27)."""
    width = 5
    x, w, b = _problem(like * width, 48, 64, True, seed=11)
    with lin.rows_like(like):
        together = lin.linear(x, w, b)
    for j in range(width):
        plain = F.linear(x[j::width].contiguous(), w, b)
        assert torch.equal(together[j::width], plain), j
    assert lin.rows_like.current is None and torch.equal(lin.linear(x[:1], w, b), F.linear(x[:1], w, b))


# ---- CUDA -------------------------------------------------------------------------------------------


@pytest.mark.cuda
@needs_cuda
def test_gemv_bf16_on_cuda_matches_cublas(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv(lin.ENV_VAR, raising=False)
    monkeypatch.delenv("NINFER_KERNELS", raising=False)
    for m in (1, 2, 5, 8, 16):
        for n, k, bias in [(1000, 999, True), (4096, 2048, False), (512, 8192, False)]:
            x, w, b = _problem(m, n, k, bias, seed=m, dtype=torch.bfloat16, device="cuda")
            assert lin.takes_gemv(x, w)
            got = lin.linear(x, w, b).float()
            ref = F.linear(x.float(), w.float(), None if b is None else b.float())
            cub = F.linear(x, w, b).float()
            assert (got - ref).abs().max().item() <= 2 * (cub - ref).abs().max().item() + 2e-2
    x = torch.randn(17, 64, device="cuda", dtype=torch.bfloat16)
    assert not lin.takes_gemv(x, torch.randn(32, 64, device="cuda", dtype=torch.bfloat16))  # > 16 rows


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("like", [1, 2])
def test_multi_row_fma_kernel_rows_are_bitwise_the_decode_kernels_on_cuda(like, monkeypatch):
    """The check MULTI_ROW_FMA rests on (see triton_gemv; passed on the H200): on the device, with the table's CUDA-core
    configs at the 27B shapes they serve (o_proj, MLP down, gate_up, lm_head-like), a rows_like product
    through the multi-row kernel equals the one-block-per-program kernel bit for bit."""
    from ninfer.kernels import triton_gemv
    from ninfer.kernels.triton_gemv import gemv

    gen = torch.Generator(device="cuda").manual_seed(like)
    for n, k in [(5120, 6144), (5120, 17408), (34816, 5120), (32768, 5120)]:
        w = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
        x = torch.randn(like * 4, k, generator=gen, device="cuda").to(torch.bfloat16)
        monkeypatch.setattr(triton_gemv, "MULTI_ROW_FMA", False)
        separate = gemv(x, w, rows_like=like)
        monkeypatch.setattr(triton_gemv, "MULTI_ROW_FMA", True)
        assert torch.equal(gemv(x, w, rows_like=like), separate), (n, k)
