"""This worker's shard of routed experts, read straight from the safetensors files,
prepared for the kernel backend the oracle picks.

    checkpoint --(16-bit, --weight-format checkpoint)--> DenseExpertWeights --> float32 reference
               --(GPTQ / compressed-tensors, or 16-bit with --weight-format w4a16)--> W4A16ExpertWeights
                                                         --> oracle: hip_fdot2 | triton | cpu | reference
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kernels.backends.base import PreparedExperts
from kernels.backends.reference import DenseReference
from kernels.formats import ExpertKeys, SafetensorsFiles, load_expert_weights, parse_quant_config
from kernels.formats.config import DENSE
from kernels.oracle import BackendUnavailable, choose_backend
from kernels.reference import DenseExpertWeights
from expert_server.config import WEIGHT_FORMATS
from protos.checkpoint import MoeCheckpoint
from protos.placement import available_host_memory

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadedShard:
    """layers[l](hidden, pair_rows, pair_experts, pair_weights) -> [T, H] float32."""

    layers: dict[int, PreparedExperts]
    kernel_backend: str
    weight_format: str


def free_memory_per_worker(device: torch.device, num_workers: int) -> int:
    """Bytes this worker may fill: the GPU's free memory, or on CPU the host's available memory
    split over the workers (which a CPU cluster runs on one host)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_host_memory() // num_workers


def load_shard(
    ckpt: MoeCheckpoint,
    start: int,
    end: int,
    device: torch.device,
    weight_format: str = "checkpoint",
    kernel_backend: str | None = None,
    group_size: int = 128,
) -> LoadedShard:
    """Experts [start, end) of every MoE layer, keyed by decoder layer index; only their tensors are read."""
    assert weight_format in WEIGHT_FORMATS, weight_format
    source = SafetensorsFiles(ckpt.tensor_files())
    quant = parse_quant_config(ckpt.quantization_config, quantize_group=group_size)
    if quant.method == DENSE and weight_format == "checkpoint":
        if kernel_backend not in (None, "reference"):
            raise BackendUnavailable(
                f"kernel backend {kernel_backend!r} runs W4A16 experts; this {ckpt.dtype} checkpoint is "
                "served unquantized by the reference: pass --weight-format w4a16 to quantize it on load"
            )
        layers = {l: DenseReference(w, ckpt.activation) for l, w in _load_dense(ckpt, source, start, end, device).items()}
        return LoadedShard(layers, "reference", str(ckpt.dtype).removeprefix("torch."))

    naming, layers, choice = ckpt.naming, {}, None
    for layer in ckpt.moe_layers:
        keys = [
            ExpertKeys(*(naming.module(layer, e, p) for p in (naming.gate, naming.up, naming.down)))
            for e in range(start, end)
        ]
        weights = load_expert_weights(source, keys, quant)
        if choice is None:
            choice = choose_backend(device, weights.scheme, ckpt.activation, forced=kernel_backend)
        layers[layer] = choice.backend.prepare(weights, ckpt.activation, device)
    scheme = weights.scheme
    logger.info("experts [%d, %d) of %d layers as %s on %r", start, end, len(layers), scheme.describe(),
                choice.backend.name)  # fmt: skip
    return LoadedShard(layers, choice.backend.name, f"w4a16 {scheme.describe()}")


def _load_dense(
    ckpt: MoeCheckpoint, source: SafetensorsFiles, start: int, end: int, device: torch.device
) -> dict[int, DenseExpertWeights]:
    """w13 is [E_w, 2I, H] (gate rows then up rows), w2 is [E_w, H, I]."""
    naming = ckpt.naming

    def read(layer: int, expert: int, proj: str) -> torch.Tensor:
        name = naming.name(layer, expert, proj)
        if name not in source:
            raise ValueError(f"{ckpt.path} lacks expert tensor {name}")
        return source[name]

    shard = {}
    for layer in ckpt.moe_layers:
        experts = range(start, end)
        w13 = torch.stack([torch.cat([read(layer, e, naming.gate), read(layer, e, naming.up)]) for e in experts])
        w2 = torch.stack([read(layer, e, naming.down) for e in experts])
        shard[layer] = DenseExpertWeights(w13=w13.to(device), w2=w2.to(device))
    nbytes = sum(w.w13.nbytes + w.w2.nbytes for w in shard.values())
    logger.info("loaded experts [%d, %d) of %d layers: %.1f MiB", start, end, len(shard), nbytes / 2**20)
    return shard
