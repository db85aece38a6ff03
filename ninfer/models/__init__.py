"""Model families. Every model takes a ForwardBatch and the caller-owned ModelCache.

Interface of a causal LM here:
  model = build_model(architecture, text_config)      # nn.Module, weights named as in the artifact
  hidden = model(batch, cache)                         # [T, H] final-normed hidden states
  logits = model.compute_logits(hidden[rows])          # [N, V] float32
  model.cache_spec()                                   # what ModelCache to allocate
  model.init_random_(seed)                             # synthetic weights, in place
  prepare_for_inference_(model)                        # after loading: merged projections, decode GEMVs
Parameters never alias each other (a tied head reads embed_tokens.weight), so the artifact
stores each tensor once and loading can adopt tensors without copies.
"""

from __future__ import annotations

from typing import Any

from torch import nn

ARCHITECTURES = ("llama", "qwen3_5", "qwen3_5_moe")


def build_model(architecture: str, config: dict[str, Any]) -> nn.Module:
    if architecture == "llama":
        from ninfer.models.llama import LlamaForCausalLM

        return LlamaForCausalLM(config)
    if architecture in ("qwen3_5", "qwen3_5_moe"):
        from ninfer.models.qwen3_5 import Qwen3_5ForCausalLM

        return Qwen3_5ForCausalLM(config)
    if architecture == "scripted":
        from ninfer.models.scripted import ScriptedModel

        return ScriptedModel(config)
    raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(ARCHITECTURES)}")


def prepare_for_inference_(model: nn.Module) -> nn.Module:
    """The run-time form of a loaded model, in place: projections that read one input merged into
    one matmul (state-dict names unchanged), and plain linears taking the Triton decode GEMV on CUDA.
    Quantize (ninfer.quant) before this, not after. Idempotent."""
    from ninfer.kernels.linear import use_decode_linears_

    if hasattr(model, "fuse_projections_"):
        model.fuse_projections_()
    use_decode_linears_(model)
    return model
