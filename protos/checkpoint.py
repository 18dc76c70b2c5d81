"""The one reader of a MoE checkpoint directory: its config, tensor names and safetensors headers.

Pool A (vLLM) and pool B (workers) each read their own copy of the model directory.
`read_checkpoint` reads config.json the way vLLM does, through the architecture's transformers
config class (`CONFIG_MAPPING[model_type].from_dict`), so every spelling transformers accepts
for a field means the same (`num_experts` / `num_local_experts`, `torch_dtype` / `dtype`,
`rope_theta` / `rope_parameters`: what `save_pretrained` of another transformers version
writes). From the config and the safetensors headers (never the tensor data) it derives the
MoE layout, where each tensor lives, and a fingerprint of the model the workers compute.

    config.json --transformers config class--> MoE facts --+--> MoeCheckpoint --> workers, loaders, handshake
    *.safetensors headers --> tensor names, shapes -------+--> fingerprint
"""
from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

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


@dataclass(frozen=True, slots=True)
class Architecture:
    """What differs between the supported model types, once the config class has normalised the
    spellings (all three answer `num_experts`, `num_experts_per_tok`, `hidden_size`, `hidden_act`)."""

    naming: ExpertNaming
    intermediate_attr: str  # config attribute holding the routed expert's intermediate size


_QWEN_NAMING = ExpertNaming("model.layers.{layer}.mlp.experts.{expert}", "gate_proj", "up_proj", "down_proj")
ARCHITECTURES: dict[str, Architecture] = {
    "qwen3_moe": Architecture(_QWEN_NAMING, "moe_intermediate_size"),
    "qwen2_moe": Architecture(_QWEN_NAMING, "moe_intermediate_size"),
    "mixtral": Architecture(
        ExpertNaming("model.layers.{layer}.block_sparse_moe.experts.{expert}", "w1", "w3", "w2"), "intermediate_size"
    ),
}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a safetensors header: where it lives and what it is, no data."""

    file: Path
    dtype: str  # safetensors' name: BF16, F32, I32, ...
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class SafetensorsHeader:
    path: Path
    tensors: dict[str, TensorEntry]
    raw: bytes  # the JSON header as stored
    data_start: int  # file offset of the first tensor byte


def read_header(path: Path) -> SafetensorsHeader:
    """The header of one safetensors file (8-byte little-endian length, JSON), without the data."""
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise CheckpointError(f"{path} is not a safetensors file (shorter than its header length)")
        (length,) = struct.unpack("<Q", prefix)
        raw = f.read(length)
    try:
        entries = json.loads(raw)
    except ValueError as err:
        raise CheckpointError(f"{path} has a broken safetensors header: {err}") from None
    entries.pop("__metadata__", None)
    tensors = {}
    for name, entry in entries.items():
        start, end = entry["data_offsets"]
        tensors[name] = TensorEntry(path, entry["dtype"], tuple(entry["shape"]), end - start)
    return SafetensorsHeader(path, tensors, raw, 8 + length)


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
    tensors: dict[str, TensorEntry]  # every tensor of `files`, by name (safetensors headers)
    quantization_config: dict[str, Any] | None  # as config.json states it; kernels/formats parses it
    fingerprint: str
    expert_bytes: int  # stored bytes of the routed experts' projection weights, all layers (scales aside)

    def tensor_files(self) -> dict[str, Path]:
        """{tensor name: the file that holds it}, for the format loaders' TensorSource."""
        return {name: entry.file for name, entry in self.tensors.items()}


def read_model_config(path: Path) -> Any:
    """config.json through the architecture's transformers config class, as vLLM's get_config
    does for a registered model_type: the class's attribute_map and its handling of legacy fields
    normalise spellings. Raises CheckpointError for a missing, broken or unsupported config."""
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{path} has no config.json")
    try:
        config_dict = json.loads(config_path.read_text())
    except ValueError as err:
        raise CheckpointError(f"{config_path} is not valid JSON: {err}") from None
    if not isinstance(config_dict, dict):
        raise CheckpointError(f"{config_path} holds a {type(config_dict).__name__}, not a JSON object")
    model_type = config_dict.get("model_type")
    if model_type not in ARCHITECTURES:
        raise CheckpointError(f"model_type {model_type!r} is not supported; supported: {sorted(ARCHITECTURES)}")
    from huggingface_hub.errors import StrictDataclassError
    from transformers import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type].from_dict(config_dict)
    except (ValueError, TypeError, KeyError, StrictDataclassError) as err:
        raise CheckpointError(f"{config_path} is not a {model_type} config transformers accepts: {err}") from None


def read_checkpoint(path: str | Path) -> MoeCheckpoint:
    """Read the MoE layout of a HF-format safetensors checkpoint directory."""
    path = Path(path)
    config = read_model_config(path)
    arch = ARCHITECTURES[config.model_type]
    naming = arch.naming
    files = tuple(sorted(path.glob("*.safetensors")))
    if not files:
        raise CheckpointError(f"{path} has no *.safetensors files")
    headers = [read_header(file) for file in files]
    tensors = {name: entry for header in headers for name, entry in header.tensors.items()}

    pattern = naming.pattern()
    experts_by_layer: dict[int, set[int]] = {}
    expert_bytes = 0
    for name, entry in tensors.items():
        if m := pattern.match(name):
            experts_by_layer.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
            expert_bytes += entry.nbytes
    if not experts_by_layer:
        raise CheckpointError(f"{path} has no routed expert tensors named like {naming.name(0, 0, naming.gate)!r}")

    num_experts = int(config.num_experts)
    for layer, experts in sorted(experts_by_layer.items()):
        if experts != set(range(num_experts)):
            raise CheckpointError(
                f"layer {layer} holds experts {sorted(experts)[:4]}... ({len(experts)}); config says {num_experts}"
            )
    hidden_size, intermediate_size = int(config.hidden_size), int(getattr(config, arch.intermediate_attr))
    # A field the config lacks takes the class's default (a real model's size): the tensors tell.
    down = tensors.get(naming.name(min(experts_by_layer), 0, naming.down))
    if down is not None and down.shape != (hidden_size, intermediate_size):
        raise CheckpointError(
            f"config says hidden_size {hidden_size}, {arch.intermediate_attr} {intermediate_size}; "
            f"the expert down projection is {list(down.shape)}, [hidden, intermediate]"
        )
    dtype = config.dtype or torch.bfloat16  # the class turns either spelling's name into a torch.dtype
    if dtype not in _DTYPES:
        raise CheckpointError(f"checkpoint dtype {dtype!r} is not one of {sorted(_DTYPES.values())}")
    quantization_config = getattr(config, "quantization_config", None)

    facts = dict(
        model_type=config.model_type,
        num_hidden_layers=int(config.num_hidden_layers),
        moe_layers=tuple(sorted(experts_by_layer)),
        num_experts=num_experts,
        top_k=int(config.num_experts_per_tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        dtype=dtype,
        activation=config.hidden_act,
    )
    return MoeCheckpoint(
        path=path,
        **facts,
        naming=naming,
        files=files,
        tensors=tensors,
        quantization_config=quantization_config,
        fingerprint=_fingerprint(facts, quantization_config, headers),
        expert_bytes=expert_bytes,
    )


def _fingerprint(facts: dict[str, Any], quantization_config: dict[str, Any] | None, headers: list[SafetensorsHeader]) -> str:
    """Identity of the model the workers compute: the MoE facts as the config class reads them,
    the quantization config, every file's tensor layout and samples of its data.

    A config re-spelled (re-saved by another transformers version) gives the same fingerprint.
    Fields only the attention pool reads (rope, norm eps, vocabulary) are outside it: the
    workers' outputs do not depend on them, and pool A's vLLM reads them from its own copy.
    """
    h = hashlib.sha256()
    facts = facts | {"dtype": _DTYPES[facts["dtype"]], "moe_layers": list(facts["moe_layers"])}
    h.update(json.dumps([facts, quantization_config], sort_keys=True).encode())
    for header in headers:
        h.update(header.path.name.encode())
        h.update(header.raw)
        size = header.path.stat().st_size
        with header.path.open("rb") as f:
            f.seek(header.data_start)
            h.update(f.read(_FINGERPRINT_SAMPLE_BYTES))
            f.seek(max(header.data_start, size - _FINGERPRINT_SAMPLE_BYTES))
            h.update(f.read(_FINGERPRINT_SAMPLE_BYTES))
    return h.hexdigest()[:32]
