"""What both pools must agree on about a MoE checkpoint: its shape and identity.

Pool A (vLLM) and pool B (workers) each read their own copy of the model
directory. `read_checkpoint` derives the MoE layout from config.json and the
safetensors headers (never the tensor data), and a fingerprint that changes
when the checkpoint's config, tensor layout or weights change.
"""
from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# Bytes of tensor data hashed at each end of every safetensors file. Weights of
# two different checkpoints with the same layout differ everywhere, so a sample
# identifies them without reading hundreds of GB on pool A.
_FINGERPRINT_SAMPLE_BYTES = 1 << 20


class CheckpointError(ValueError):
    """A model directory this project cannot serve, with the reason."""


@dataclass(frozen=True, slots=True)
class ExpertNaming:
    """Checkpoint tensor names of one routed expert's projections."""

    prefix: str  # format string with {layer} and {expert}
    gate: str
    up: str
    down: str

    def module(self, layer: int, expert: int, proj: str) -> str:
        return f"{self.prefix.format(layer=layer, expert=expert)}.{proj}"

    def name(self, layer: int, expert: int, proj: str) -> str:
        """The 16-bit weight tensor's name."""
        return f"{self.module(layer, expert, proj)}.weight"

    def pattern(self) -> re.Pattern[str]:
        """Matches a projection's weight: 16-bit, GPTQ `qweight` or compressed-tensors `weight_packed`."""
        prefix = re.escape(self.prefix).replace(r"\{layer\}", r"(\d+)").replace(r"\{expert\}", r"(\d+)")
        return re.compile(rf"^{prefix}\.({self.gate}|{self.up}|{self.down})\.(weight|qweight|weight_packed)$")


_QWEN_NAMING = ExpertNaming("model.layers.{layer}.mlp.experts.{expert}", "gate_proj", "up_proj", "down_proj")

# model_type -> (naming, config key for the routed expert intermediate size, config key for E)
ARCHITECTURES: dict[str, tuple[ExpertNaming, str, str]] = {
    "qwen3_moe": (_QWEN_NAMING, "moe_intermediate_size", "num_experts"),
    "qwen2_moe": (_QWEN_NAMING, "moe_intermediate_size", "num_experts"),
    "mixtral": (
        ExpertNaming("model.layers.{layer}.block_sparse_moe.experts.{expert}", "w1", "w3", "w2"),
        "intermediate_size",
        "num_local_experts",
    ),
}


@dataclass(frozen=True, slots=True)
class MoeCheckpoint:
    path: Path
    model_type: str
    num_hidden_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    dtype: torch.dtype
    activation: str
    naming: ExpertNaming
    files: tuple[Path, ...]
    fingerprint: str
    expert_bytes: int  # stored bytes of the routed experts' projection weights, all layers (scales aside)


def _read_header(path: Path) -> tuple[bytes, int]:
    """Raw JSON header bytes of a safetensors file and the offset where data starts."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return f.read(length), 8 + length


def _fingerprint(config_bytes: bytes, files: tuple[Path, ...]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(json.loads(config_bytes), sort_keys=True).encode())
    for path in files:
        header, data_start = _read_header(path)
        h.update(path.name.encode())
        h.update(header)
        size = path.stat().st_size
        with path.open("rb") as f:
            f.seek(data_start)
            h.update(f.read(_FINGERPRINT_SAMPLE_BYTES))
            f.seek(max(data_start, size - _FINGERPRINT_SAMPLE_BYTES))
            h.update(f.read(_FINGERPRINT_SAMPLE_BYTES))
    return h.hexdigest()[:32]


def read_checkpoint(path: str | Path) -> MoeCheckpoint:
    """Read the MoE layout of a HF-format safetensors checkpoint directory."""
    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{path} has no config.json")
    config_bytes = config_path.read_bytes()
    config = json.loads(config_bytes)
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise CheckpointError(
            f"model_type {model_type!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    naming, intermediate_key, experts_key = ARCHITECTURES[model_type]
    files = tuple(sorted(path.glob("*.safetensors")))
    if not files:
        raise CheckpointError(f"{path} has no *.safetensors files")

    pattern = naming.pattern()
    experts_by_layer: dict[int, set[int]] = {}
    expert_bytes = 0
    for file in files:
        header, _ = _read_header(file)
        for name, entry in json.loads(header).items():
            if m := pattern.match(name):
                experts_by_layer.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
                start, end = entry["data_offsets"]
                expert_bytes += end - start
    if not experts_by_layer:
        raise CheckpointError(f"{path} has no routed expert tensors named like {naming.name(0, 0, naming.gate)!r}")

    num_experts = int(config[experts_key])
    for layer, experts in sorted(experts_by_layer.items()):
        if experts != set(range(num_experts)):
            raise CheckpointError(
                f"layer {layer} holds experts {sorted(experts)[:4]}...; config says {num_experts}"
            )
    dtype_name = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    if dtype_name not in _DTYPES:
        raise CheckpointError(f"checkpoint dtype {dtype_name!r} is not one of {sorted(_DTYPES)}")

    return MoeCheckpoint(
        path=path,
        model_type=model_type,
        num_hidden_layers=int(config["num_hidden_layers"]),
        moe_layers=tuple(sorted(experts_by_layer)),
        num_experts=num_experts,
        top_k=int(config["num_experts_per_tok"]),
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config[intermediate_key]),
        dtype=_DTYPES[dtype_name],
        activation=config.get("hidden_act", "silu"),
        naming=naming,
        files=files,
        fingerprint=_fingerprint(config_bytes, files),
        expert_bytes=expert_bytes,
    )
