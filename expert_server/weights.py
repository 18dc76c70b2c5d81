"""This worker's shard of routed experts, read straight from the safetensors files."""
from __future__ import annotations

import logging

import torch
from safetensors import safe_open

from kernels.reference import DenseExpertWeights
from protos.checkpoint import MoeCheckpoint

logger = logging.getLogger(__name__)


def load_shard(
    ckpt: MoeCheckpoint, start: int, end: int, device: torch.device
) -> dict[int, DenseExpertWeights]:
    """Experts [start, end) of every MoE layer, keyed by decoder layer index.

    Only the tensors of these experts are read; w13 is [E_w, 2I, H] (gate rows
    then up rows), w2 is [E_w, H, I].
    """
    naming = ckpt.naming
    wanted = {
        naming.name(layer, e, proj)
        for layer in ckpt.moe_layers
        for e in range(start, end)
        for proj in (naming.gate, naming.up, naming.down)
    }
    tensors: dict[str, torch.Tensor] = {}
    for file in ckpt.files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in wanted.intersection(f.keys()):
                tensors[name] = f.get_tensor(name)
    missing = wanted - tensors.keys()
    if missing:
        raise ValueError(f"{ckpt.path} lacks {len(missing)} expert tensors, e.g. {sorted(missing)[0]}")

    shard = {}
    for layer in ckpt.moe_layers:
        experts = range(start, end)
        w13 = torch.stack(
            [torch.cat([tensors[naming.name(layer, e, naming.gate)], tensors[naming.name(layer, e, naming.up)]]) for e in experts]
        )
        w2 = torch.stack([tensors[naming.name(layer, e, naming.down)] for e in experts])
        shard[layer] = DenseExpertWeights(w13=w13.to(device), w2=w2.to(device))
    nbytes = sum(w.w13.nbytes + w.w2.nbytes for w in shard.values())
    logger.info("loaded experts [%d, %d) of %d layers: %.1f MiB", start, end, len(shard), nbytes / 2**20)
    return shard
