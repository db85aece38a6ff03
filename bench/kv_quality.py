"""What a quantized KV cache costs in quality: teacher-forced next-token loss over a long text, per --kv-dtype.

  python bench/kv_quality.py --artifact models/smollm2-135m-instruct.ninfer --dtype int8 --tokens 6144

The text (default: the repository's README and the serving contract, concatenated) is run through the model in
prefill chunks against a cache of each KV dtype; every query attends to the cached, quantized K/V of all tokens
before it (the prefill reads them back from the cache, as a decode step does), so the loss is what decoding
would see. Per dtype it prints one JSON line: mean negative log-likelihood and perplexity over context bins,
and how often the argmax (greedy's choice) equals the bf16 cache's at the same position, with the mean KL
divergence from the bf16 cache's next-token distribution.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from ninfer.artifact.container import Artifact  # noqa: E402
from ninfer.forward import KV_DTYPES, ForwardBatch, ModelCache  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TEXT = [ROOT / "README.md", ROOT.parent / "shared" / "spec" / "serving.md"]


def load(artifact_path: str, dtype: str):
    from ninfer.engine.loader import load_model, pick_dtype
    from ninfer.tokenizer import Tokenizer

    artifact = Artifact(artifact_path)
    device = torch.device("cpu")
    model = load_model(artifact, device, pick_dtype(dtype, device))
    if dtype == "int8":
        from ninfer.quant.int8_cpu import quantize_model_int8_

        quantize_model_int8_(model)
    return model, Tokenizer.from_json_str(artifact.tokenizer_json), pick_dtype(dtype, device)


@torch.inference_mode()
def log_probs(model, ids: list[int], kv_dtype: str, act_dtype: torch.dtype, page_size: int, chunk: int) -> torch.Tensor:
    """[len(ids) - 1, V] fp32 log-probabilities of each next token, the text run in chunks through a kv_dtype cache."""
    spec = model.cache_spec()
    pages = (len(ids) + page_size - 1) // page_size
    cache = ModelCache(spec, pages, page_size, 1, act_dtype, kv_dtype=kv_dtype)
    table = list(range(pages))
    out = []
    for start in range(0, len(ids) - 1, chunk):
        piece = ids[start: min(start + chunk, len(ids) - 1)]
        batch = ForwardBatch.build([piece], [start], [table], page_size, all_logits=True)
        hidden = model(batch, cache)
        out.append(torch.log_softmax(model.compute_logits(hidden[batch.logit_indices()]).float(), -1))
    return torch.cat(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", default=str(ROOT / "models" / "smollm2-135m-instruct.ninfer"))
    ap.add_argument("--dtype", default="int8", choices=["auto", "fp32", "bf16", "int8"])
    ap.add_argument("--kv-dtypes", nargs="+", default=list(KV_DTYPES), choices=KV_DTYPES)
    ap.add_argument("--tokens", type=int, default=6144, help="text tokens (the context the last position sees)")
    ap.add_argument("--bins", type=int, nargs="+", default=[1024, 3072], help="context bin edges for the loss")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--text", nargs="*", default=None, help="text files (default: README.md and the serving contract)")
    args = ap.parse_args()

    model, tokenizer, act_dtype = load(args.artifact, args.dtype)
    text = "\n\n".join(Path(p).read_text() for p in (args.text or [p for p in DEFAULT_TEXT if p.exists()]))
    ids = tokenizer.encode(text)[: args.tokens]
    if len(ids) < args.tokens:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than --tokens {args.tokens}")
    target = torch.tensor(ids[1:])
    edges = [0, *[b for b in args.bins if b < len(target)], len(target)]
    reference = None
    for kv in ["bf16", *[k for k in args.kv_dtypes if k != "bf16"]]:
        t0 = time.perf_counter()
        lp = log_probs(model, ids, kv, act_dtype, 16, args.chunk)
        nll = -lp.gather(1, target[:, None])[:, 0]
        bins = {f"{a}-{b}": round(nll[a:b].mean().item(), 4) for a, b in zip(edges, edges[1:])}
        row = {"kv_dtype": kv, "tokens": len(ids), "nll": round(nll.mean().item(), 4),
               "ppl": round(math.exp(nll.mean().item()), 3), "nll_by_context": bins,
               "seconds": round(time.perf_counter() - t0, 1)}
        if reference is None:
            reference = lp
        else:
            row["argmax_equal_bf16"] = round((lp.argmax(-1) == reference.argmax(-1)).float().mean().item(), 4)
            row["kl_from_bf16"] = round((reference.exp() * (reference - lp)).sum(-1).mean().item(), 5)
        row.update(model=args.artifact, dtype=args.dtype, command=" ".join(sys.argv))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
