"""Weight quantization formats (NVFP4 for now): quantizers, torch references and the linear modules."""

from ninfer.quant.nvfp4 import (
    GROUP_SIZE,
    NVFP4Linear,
    NVFP4Weight,
    dequantize_nvfp4,
    quantizable,
    quantize_model_,
    quantize_nvfp4,
    replace_with_nvfp4_,
)

__all__ = [
    "GROUP_SIZE", "NVFP4Linear", "NVFP4Weight", "dequantize_nvfp4", "quantizable", "quantize_model_",
    "quantize_nvfp4", "replace_with_nvfp4_",
]
