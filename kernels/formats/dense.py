"""16-bit projections quantized on load: symmetric int4, one float32 scale per group."""
from __future__ import annotations

from kernels.formats.config import CheckpointQuant
from kernels.formats.source import TensorSource, require
from kernels.quant import Int4Weights, UnsupportedQuantization, quantize_symmetric


def load_dense(source: TensorSource, prefix: str, quant: CheckpointQuant) -> Int4Weights:
    """One 16-bit projection `prefix` ([N, K] weight) -> Int4Weights with one expert."""
    require(source, prefix, ("weight",), "16-bit")
    if f"{prefix}.bias" in source:
        raise UnsupportedQuantization(f"{prefix}: expert bias is not supported")
    weight = source[f"{prefix}.weight"]  # [N, K]
    if not weight.is_floating_point():
        raise UnsupportedQuantization(f"{prefix}.weight is {weight.dtype}, not a float to quantize")
    group_size = weight.shape[1] if quant.group_size == -1 else quant.group_size
    return quantize_symmetric(weight.unsqueeze(0), group_size)
