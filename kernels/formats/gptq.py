"""GPTQ int4 projections: qweight [K/8, N] packed along K, qzeros [K/G, N/8], scales [K/G, N], g_idx [K].

v1 checkpoints (`checkpoint_format: gptq`, auto-gptq, auto-round) store zero - 1, so a
symmetric layer reads 7 everywhere and the real zero is 8. Zeros and g_idx are read from
the tensors, never assumed from the config's `sym` / `desc_act`.
"""
from __future__ import annotations

import torch

from kernels.formats.config import CheckpointQuant, FormatMismatch
from kernels.formats.source import TensorSource, require
from kernels.quant import SYMMETRIC_ZERO, Int4Weights, UnsupportedQuantization, unpack_int4

TENSORS = ("qweight", "qzeros", "scales")


def load_gptq(source: TensorSource, prefix: str, quant: CheckpointQuant) -> Int4Weights:
    """One GPTQ projection `prefix` -> Int4Weights with one expert, [1, N, K]."""
    require(source, prefix, TENSORS, "GPTQ")
    if f"{prefix}.bias" in source:
        raise UnsupportedQuantization(f"{prefix}: expert bias is not supported")
    qweight = source[f"{prefix}.qweight"]  # [K/8, N] int32
    scales = source[f"{prefix}.scales"].float()  # [K/G, N]
    words, n = qweight.shape
    k = words * 8
    if scales.shape[1] != n or qweight.dtype != torch.int32:
        raise FormatMismatch(
            f"{prefix}: qweight {tuple(qweight.shape)} {qweight.dtype} and scales {tuple(scales.shape)} "
            "are not GPTQ's [K/8, N] int32 / [K/G, N] (AWQ packs along N)"
        )
    group_size = k if quant.group_size == -1 else quant.group_size
    if scales.shape[0] * group_size != k:
        raise FormatMismatch(f"{prefix}: scales {tuple(scales.shape)} do not match K={k}, group {group_size}")

    zeros = unpack_int4(source[f"{prefix}.qzeros"])[:, :n]  # [K/G, N] stored nibbles
    if quant.gptq_v1_zeros:
        zeros = (zeros + 1) & 0xF
    g_idx = _act_order(source, prefix, k, group_size)
    return Int4Weights(
        packed=qweight.t().contiguous().unsqueeze(0),  # [1, N, K/8]: nibble i of word j is k = 8j + i
        scales=scales.t().contiguous().unsqueeze(0),  # [1, N, K/G]
        group_size=group_size,
        zeros=None if bool((zeros == SYMMETRIC_ZERO).all()) else zeros.t().contiguous().unsqueeze(0),
        g_idx=g_idx,
    )


def _act_order(source: TensorSource, prefix: str, k: int, group_size: int) -> torch.Tensor | None:
    """[1, K] int32 g_idx when it is not the plain k // G, else None."""
    if f"{prefix}.g_idx" not in source:
        return None
    g_idx = source[f"{prefix}.g_idx"].to(torch.int32)  # [K]
    if torch.equal(g_idx, torch.arange(k, dtype=torch.int32) // group_size):
        return None
    return g_idx.unsqueeze(0)
