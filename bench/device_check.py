"""CUDA check of the foundation and engine: tiny presets agree with the CPU reference, the engine's
greedy output on CUDA is batch-invariant, and the full-size shapes run forward. One JSON per line.

  python bench/device_check.py            # on a GPU host; NINFER_QWEN_TOKENIZER_JSON if offline
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from ninfer.artifact.presets import get_preset, instantiate, tokenizer_json_for  # noqa: E402
from ninfer.chat.thinking import thinking_control
from ninfer.engine.engine import Engine, EngineSettings  # noqa: E402
from ninfer.engine.types import EngineRequest, SamplingParams, TokenEvent  # noqa: E402
from ninfer.forward import ForwardBatch, ModelCache  # noqa: E402
from ninfer.models import build_model  # noqa: E402
from ninfer.tokenizer import Tokenizer  # noqa: E402


def emit(**record):
    print(json.dumps(record), flush=True)


def ragged_logits(model, device, dtype):
    """A mixed step: one sequence prefills 37 tokens, then a second step decodes it with a fresh 5-token one."""
    cache = ModelCache(model.cache_spec(), num_pages=32, page_size=16, num_state_slots=4, dtype=dtype, device=device)
    a = [(13 * i) % 5000 + 100 for i in range(37)]
    b = [7, 8, 9, 10, 11]
    with torch.inference_mode():
        first = ForwardBatch.build([a], [0], [[3, 1, 4]], 16, [2], device)
        l1 = model.compute_logits(model(first, cache)[first.last_token_indices()])
        second = ForwardBatch.build([[42], b], [37, 0], [[3, 1, 4], [9]], 16, [2, 0], device)
        l2 = model.compute_logits(model(second, cache)[second.last_token_indices()])
    return torch.cat([l1, l2]).float().cpu()


def check_tiny(name):
    cpu_model = instantiate(name, "cpu", torch.float32, seed=0)
    ref = ragged_logits(cpu_model, "cpu", torch.float32)
    preset = get_preset(name)
    for dtype in (torch.float32, torch.bfloat16):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        with torch.device("cuda"):
            gpu_model = build_model(preset.architecture, preset.text_config())
        torch.set_default_dtype(previous)
        gpu_model.load_state_dict({k: v.to(dtype) for k, v in cpu_model.state_dict().items()})
        got = ragged_logits(gpu_model.eval(), torch.device("cuda"), dtype)
        emit(check="cuda_vs_cpu_logits", model=name, dtype=str(dtype), max_abs_diff=(got - ref).abs().max().item(),
             ref_std=ref.std().item(), argmax_equal=bool((got.argmax(-1) == ref.argmax(-1)).all()))


def engine_batch_invariance(name):
    preset = get_preset(name)
    model = instantiate(name, "cuda", torch.float32, seed=0)
    tok = Tokenizer.from_json_str(tokenizer_json_for(preset)[0])
    prompts = [[(7 * i + 13 * j) % 900 + 50 for j in range(n)] for i, n in enumerate([3, 17, 5, 40, 9, 26, 2, 33])]

    def run(concurrency):
        engine = Engine(model, tok, EngineSettings(max_context=256, max_concurrency=concurrency, prefill_chunk=16,
                                                   eos_ids=set()), device="cuda", dtype=torch.float32, thinking=thinking_control(tok)).start()
        reqs = [EngineRequest(f"r{i}", p, max_tokens=12, sampling=SamplingParams(temperature=0.0))
                for i, p in enumerate(prompts)]

        async def main():
            async def one(r):
                return [i for e in [x async for x in engine.stream(r)] if isinstance(e, TokenEvent)
                        for i in e.token_ids]
            return await asyncio.gather(*(one(r) for r in reqs))
        try:
            return asyncio.run(main())
        finally:
            engine.shutdown()

    alone, batched = run(1), run(8)
    emit(check="engine_greedy_alone_vs_batch8_cuda", model=name, identical=alone == batched)


def full_shape(name):
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = instantiate(name, "cuda", torch.bfloat16, seed=0)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    logits = ragged_logits(model, torch.device("cuda"), torch.bfloat16)
    emit(check="full_shape_forward", model=name, parameters=params, weight_bytes=params * 2, build_s=build_s,
         peak_gpu_bytes=torch.cuda.max_memory_allocated(), finite=bool(torch.isfinite(logits).all()))
    del model
    torch.cuda.empty_cache()


def main():
    emit(check="device", name=torch.cuda.get_device_name(), torch=torch.__version__)
    for name in ("tiny-llama", "tiny-qwen3.6", "tiny-qwen3.6-moe"):
        check_tiny(name)
    for name in ("tiny-qwen3.6", "tiny-qwen3.6-moe"):
        engine_batch_invariance(name)
    for name in sys.argv[1:] or ("qwen3.6-27b",):
        full_shape(name)


if __name__ == "__main__":
    main()
