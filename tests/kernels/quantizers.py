"""Other projects' quantizers, the references our own quantize-on-load is held to."""
from __future__ import annotations

import pytest
import torch


def compressed_tensors_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values in -8..7 [N, K], scales [N, K/G]) of float32 weights [N, K], by the compressed-tensors
    library's own observer formula and quantizer (symmetric int4, per group)."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors (vLLM's dependency) is not installed")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    groups = w.unflatten(-1, (-1, group))  # [N, K/G, G]
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    return quantize(w, scale, zero, args).to(torch.int64), scale
