"""This worker's shard of routed experts, read straight from the safetensors files,
prepared for the kernel backend the oracle picks.

    checkpoint --(16-bit, --weight-format checkpoint)--> DenseExpertWeights --> float32 reference
               --(GPTQ / compressed-tensors, or 16-bit with --weight-format w4a16)--> W4A16ExpertWeights
                                                         --> oracle: hip_fdot2 | triton | cpu | reference
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
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
    weight_format: str  # what the experts are, e.g. "bfloat16", "w4a16 int4 sym group 128"
    load_format: str = "checkpoint"  # how they were loaded: "checkpoint" (as stored) or "w4a16" (quantized on load)
    group_size: int = 0  # the quantize-on-load group; 0 when loaded as stored


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
    experts = {layer: range(start, end) for layer in ckpt.moe_layers}
    return load_experts(ckpt, experts, device, weight_format, kernel_backend, group_size)


def load_experts(
    ckpt: MoeCheckpoint,
    experts: dict[int, Sequence[int]],
    device: torch.device,
    weight_format: str = "checkpoint",
    kernel_backend: str | None = None,
    group_size: int = 128,
) -> LoadedShard:
    """experts[layer]: the global expert ids to load for that MoE layer, in the order their pairs will
    index them (a worker's shard range; the attention node's hot experts). Only their tensors are read."""
    assert weight_format in WEIGHT_FORMATS, weight_format
    assert experts and all(experts.values()), "at least one expert per layer loaded"
    source = SafetensorsFiles(ckpt.tensor_files())
    quant = parse_quant_config(ckpt.quantization_config, quantize_group=group_size)
    if quant.method == DENSE and weight_format == "checkpoint":
        if kernel_backend not in (None, "reference"):
            raise BackendUnavailable(
                f"kernel backend {kernel_backend!r} runs W4A16 experts; this {ckpt.dtype} checkpoint is "
                "served unquantized by the reference: pass --weight-format w4a16 to quantize it on load"
            )
        layers = {l: DenseReference(w, ckpt.activation) for l, w in _load_dense(ckpt, source, experts, device).items()}
        return LoadedShard(layers, "reference", str(ckpt.dtype).removeprefix("torch."))
    quantized_on_load = quant.method == DENSE  # and weight_format == "w4a16"

    naming, layers, choice = ckpt.naming, {}, None
    for layer, ids in experts.items():
        keys = [ExpertKeys(*(naming.module(layer, e, p) for p in (naming.gate, naming.up, naming.down))) for e in ids]
        weights = load_expert_weights(source, keys, quant)
        if choice is None:
            choice = choose_backend(device, weights.scheme, ckpt.activation, forced=kernel_backend)
        layers[layer] = choice.backend.prepare(weights, ckpt.activation, device)
    scheme = weights.scheme
    logger.info("%s of %d layers as %s on %r", _describe(experts), len(layers), scheme.describe(),
                choice.backend.name)  # fmt: skip
    return LoadedShard(layers, choice.backend.name, f"w4a16 {scheme.describe()}", weight_format if quantized_on_load
                       else "checkpoint", group_size if quantized_on_load else 0)  # fmt: skip


def loaded_expert_bytes(ckpt: MoeCheckpoint, load_format: str, group_size: int) -> int:
    """One routed expert's weights as loaded: as stored, or int4 plus a 16-bit scale per group (the
    unit of the attention node's --hot-expert-bytes and --spare-expert-bytes budgets)."""
    stored = ckpt.expert_bytes // (len(ckpt.moe_layers) * ckpt.num_experts)
    if load_format == "checkpoint":
        return stored
    weights = stored // ckpt.dtype.itemsize  # 16-bit elements
    return weights // 2 + weights // group_size * 2


def _describe(experts: dict[int, Sequence[int]]) -> str:
    ids = next(iter(experts.values()))
    if isinstance(ids, range) and all(e == ids for e in experts.values()):
        return f"experts [{ids.start}, {ids.stop})"
    return f"{sum(len(e) for e in experts.values())} experts"


def _load_dense(
    ckpt: MoeCheckpoint, source: SafetensorsFiles, experts: dict[int, Sequence[int]], device: torch.device
) -> dict[int, DenseExpertWeights]:
    """w13 is [E_w, 2I, H] (gate rows then up rows), w2 is [E_w, H, I]."""
    naming = ckpt.naming

    def read(layer: int, expert: int, proj: str) -> torch.Tensor:
        name = naming.name(layer, expert, proj)
        if name not in source:
            raise ValueError(f"{ckpt.path} lacks expert tensor {name}")
        return source[name]

    shard = {}
    for layer, ids in experts.items():
        w13 = torch.stack([torch.cat([read(layer, e, naming.gate), read(layer, e, naming.up)]) for e in ids])
        w2 = torch.stack([read(layer, e, naming.down) for e in ids])
        shard[layer] = DenseExpertWeights(w13=w13.to(device), w2=w2.to(device))
    nbytes = sum(w.w13.nbytes + w.w2.nbytes for w in shard.values())
    logger.info("loaded %s of %d layers: %.1f MiB", _describe(experts), len(shard), nbytes / 2**20)
    return shard
