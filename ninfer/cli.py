"""`ninfer` command line: serve, convert, convert-drafter, convert-draft-head, info."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_ARTIFACT = Path("models/smollm2-135m-instruct.ninfer")

_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
           "fp32": "float32", "float32": "float32"}


def _dtype(name: str):
    import torch

    try:
        return getattr(torch, _DTYPES[name])
    except KeyError:
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r}; use one of {sorted(_DTYPES)}") from None


def build_default(out: Path = DEFAULT_ARTIFACT, force: bool = False) -> Path:
    """The embedded default (SmolLM2-135M-Instruct, bf16); built once, then reused."""
    from ninfer.artifact.convert_gguf import SMOLLM2_SAMPLING, convert_gguf, default_smollm2_gguf

    if out.exists() and not force:
        print(f"{out} exists; reusing it", file=sys.stderr)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    convert_gguf(default_smollm2_gguf(), out, name="smollm2-135m-instruct", sampling_presets=SMOLLM2_SAMPLING)
    return out


def _cmd_convert(args: argparse.Namespace) -> int:
    out = Path(args.output)
    if args.source == "default":
        build_default(out if args.output else DEFAULT_ARTIFACT, force=args.force)
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.source == "gguf":
        from ninfer.artifact.convert_gguf import convert_gguf

        convert_gguf(args.input, out, dtype=args.dtype, name=args.name, progress=not args.quiet)
    elif args.source == "hf":
        from ninfer.artifact.convert_hf import convert_hf

        convert_hf(args.input, out, dtype=args.dtype, name=args.name, progress=not args.quiet,
                   keep_template=args.keep_template, weights=args.weights, nvfp4_lm_head=args.nvfp4_lm_head,
                   nvfp4_mtp=args.nvfp4_mtp)
    elif args.source == "synthetic":
        from ninfer.artifact.presets import write_preset

        write_preset(args.preset, out, seed=args.seed, dtype=args.dtype, weights=args.weights,
                     nvfp4_lm_head=args.nvfp4_lm_head)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _cmd_convert_drafter(args: argparse.Namespace) -> int:
    from ninfer.artifact.convert_drafter import import_drafter

    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    import_drafter(args.input, args.drafter, out, args.variant)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _cmd_convert_draft_head(args: argparse.Namespace) -> int:
    from ninfer.models.draft_head import add_draft_head

    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    add_draft_head(args.input, out, args.tokens, corpus=args.corpus)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    from ninfer.artifact.container import Artifact

    art = Artifact(args.artifact)
    m = art.manifest
    print(json.dumps({
        "path": str(art.path), "name": m.name, "public_name": art.public_name, "architecture": m.architecture,
        "components": m.components, "quantization": m.quantization, "sampling_presets": m.sampling_presets,
        "extra": m.extra, "tensors": len(art.tensor_names), "chat_template_chars": len(art.chat_template),
        "tokenizer_json_chars": len(art.tokenizer_json),
    }, indent=2))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from ninfer.server.launch import config_from_args, run

    return run(config_from_args(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ninfer", description="ninfer: Qwen3.5/3.6 inference server")
    sub = parser.add_subparsers(dest="command", required=True)

    convert = sub.add_parser("convert", help="make .ninfer artifacts",
                             description="Make .ninfer v3 artifacts from GGUF, Hugging Face folders or presets.")
    csub = convert.add_subparsers(dest="source", required=True)

    def common(p: argparse.ArgumentParser, dtype_default: str = "bf16") -> None:
        p.add_argument("-o", "--output", required=True, help="output .ninfer path")
        p.add_argument("--dtype", type=_dtype, default=_dtype(dtype_default), help="tensor dtype (bf16, fp16, fp32)")
        p.add_argument("--quiet", action="store_true", help="no progress bar")

    def weights_option(p: argparse.ArgumentParser, checkpoint: bool = False) -> None:
        choices = ["auto", "bf16", "nvfp4"] if checkpoint else ["bf16", "nvfp4"]
        p.add_argument("--weights", choices=choices, default=choices[0],
                       help="decoder linear weights: bf16 = unquantized (stored in --dtype), nvfp4 = quantized at "
                            "conversion (E2M1 + E4M3 scale per 16 + fp32 scale; embeddings, lm_head unless "
                            "--nvfp4-lm-head, the MoE router and shared-expert gate, GDN's in_proj_a/b stay in "
                            "--dtype)" + (
                                "; auto (default) keeps the checkpoint's: an NVFP4 checkpoint (ModelOpt or "
                                "compressed-tensors) stays NVFP4, bf16 = dequantize it" if checkpoint else ""))
        p.add_argument("--nvfp4-lm-head", action="store_true",
                       help="with --weights nvfp4: also quantize the output projection (lm_head) to NVFP4: a "
                            "smaller, faster decode step, but the logits carry the 4-bit error (ModelOpt "
                            "checkpoints usually keep lm_head in bf16). A tied lm_head (the embedding table) "
                            "stays in --dtype")

    g = csub.add_parser("gguf", help="GGUF file -> .ninfer, dequantized (the embedded default's path)")
    g.add_argument("input", help="path to a .gguf file (Llama architecture)")
    g.add_argument("--name", help="public model name (default: the GGUF general.name)")
    common(g)

    h = csub.add_parser("hf", help="Hugging Face checkpoint folder -> .ninfer (llama, qwen3_5, qwen3_5_moe)")
    h.add_argument("input", help="folder with config.json, *.safetensors, tokenizer.json")
    h.add_argument("--name", help="public model name (default: the folder name)")
    h.add_argument("--keep-template", action="store_true",
                   help="store the checkpoint's own chat template instead of ninfer's maintained Qwen template")
    common(h)
    weights_option(h, checkpoint=True)
    h.add_argument("--nvfp4-mtp", action="store_true",
                   help="with --weights nvfp4: also quantize the MTP head's decoder layer (--spec mtp drafts read "
                        "a quarter of its bytes; the drafts carry the 4-bit error, the output never does: every "
                        "draft is verified). An NVFP4 checkpoint's quantized MTP layer stays NVFP4 without it")

    s = csub.add_parser("synthetic", help="random-weight artifact from a named preset")
    s.add_argument("--preset", required=True, choices=["tiny-llama", "tiny-qwen3.6", "tiny-qwen3.6-moe"])
    s.add_argument("--seed", type=int, default=0)
    common(s, "fp32")
    weights_option(s)

    d = csub.add_parser("default", help="build the embedded default (SmolLM2-135M-Instruct) once")
    d.add_argument("-o", "--output", default=str(DEFAULT_ARTIFACT), help=f"output path (default {DEFAULT_ARTIFACT})")
    d.add_argument("--force", action="store_true", help="rebuild even if it exists")

    dr = sub.add_parser("convert-drafter", help="add a DFlash / DFlash2 drafter checkpoint to an artifact",
                        description="Copy an artifact with a z-lab drafter checkpoint (config.json + "
                                    "*.safetensors) added as its dflash or dflash2 component.")
    dr.add_argument("input", help="the .ninfer artifact of the target model")
    dr.add_argument("drafter", help="the drafter's folder (config.json, *.safetensors)")
    dr.add_argument("output", help="output .ninfer path")
    dr.add_argument("--variant", choices=["dflash", "dflash2"],
                    help="drafter kind (default: as the checkpoint's config.json declares)")

    dh = sub.add_parser("convert-draft-head", help="add the proposal head (--lm-head-draft) to an artifact",
                        description="Copy an artifact with a draft_head component: the lm_head rows of a token "
                                    "shortlist that drafters score their proposals on.")
    dh.add_argument("input", help="the .ninfer artifact (its text lm_head or tied embedding in bf16/fp32)")
    dh.add_argument("output", help="output .ninfer path")
    dh.add_argument("--tokens", type=int, default=131072, help="shortlist size (default: 131072)")
    dh.add_argument("--corpus", help="a text file whose token frequencies rank the shortlist (default: token id "
                                     "order, which byte-level BPE roughly sorts by frequency)")

    info = sub.add_parser("info", help="print an artifact's manifest")
    info.add_argument("artifact")

    from ninfer.server.launch import add_serve_arguments

    serve = sub.add_parser("serve", help="serve an artifact over HTTP through Ray Serve",
                           description="Serve one .ninfer artifact (OpenAI-compatible HTTP) as a Ray Serve "
                                       "application: the same graph as `serve run configs/*.yaml`.")
    add_serve_arguments(serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "nvfp4_lm_head", False) and args.weights != "nvfp4":
        parser.error(f"convert {args.source}: --nvfp4-lm-head needs --weights nvfp4 (got --weights {args.weights})")
    if getattr(args, "nvfp4_mtp", False) and args.weights != "nvfp4":
        parser.error(f"convert {args.source}: --nvfp4-mtp needs --weights nvfp4 (got --weights {args.weights})")
    commands = {"convert": _cmd_convert, "convert-drafter": _cmd_convert_drafter,
                "convert-draft-head": _cmd_convert_draft_head, "info": _cmd_info,
                "serve": _cmd_serve}
    try:
        return commands[args.command](args)
    except (ValueError, FileNotFoundError) as exc:  # ArtifactError and converter input problems
        print(f"ninfer {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
