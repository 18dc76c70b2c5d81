"""What a checkpoint's `quantization_config` says about its routed experts.

Accepted: GPTQ int4 (`quant_method: gptq`), compressed-tensors `pack-quantized` int4
weight-only, and 16-bit checkpoints quantized on load. Everything else is refused here,
by name, before a tensor is read.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kernels.quant import UnsupportedQuantization

GPTQ = "gptq"
COMPRESSED_TENSORS = "compressed-tensors"
DENSE = "dense"
PACK_QUANTIZED = "pack-quantized"
DEFAULT_GROUP = 128


class FormatMismatch(ValueError):
    """The tensors on disk are of another format than the one being loaded."""


@dataclass(frozen=True, slots=True)
class CheckpointQuant:
    """How the expert projections of a checkpoint are stored.

    method:         GPTQ, COMPRESSED_TENSORS or DENSE (16-bit, quantized on load)
    group_size:     input columns per scale; -1 means one group per row (channel)
    gptq_v1_zeros:  GPTQ v1 stores zero - 1 (symmetric zeros read as 7)
    ignore:         compressed-tensors modules left in 16 bits (names or `re:` patterns)
    """

    method: str
    group_size: int = DEFAULT_GROUP
    gptq_v1_zeros: bool = True
    ignore: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        assert self.method in (GPTQ, COMPRESSED_TENSORS, DENSE), f"unknown method {self.method}"
        if self.group_size != -1 and (self.group_size <= 0 or self.group_size % 8):
            raise UnsupportedQuantization(f"group size {self.group_size} is not a positive multiple of 8")

    def is_ignored(self, module: str) -> bool:
        """True when compressed-tensors left `module` unquantized."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return True
            elif entry == module:
                return True
        return False


def parse_quant_config(config: dict[str, Any] | None, quantize_group: int = DEFAULT_GROUP) -> CheckpointQuant:
    """config.json's `quantization_config` (None for a 16-bit checkpoint) -> CheckpointQuant."""
    if not config:
        return CheckpointQuant(DENSE, group_size=quantize_group)
    method = config.get("quant_method")
    if method == GPTQ:
        return _parse_gptq(config)
    if method == COMPRESSED_TENSORS:
        return _parse_compressed_tensors(config)
    raise UnsupportedQuantization(f"quant_method {method!r}: only gptq and compressed-tensors are read")


def _parse_gptq(config: dict[str, Any]) -> CheckpointQuant:
    bits = config.get("bits", 4)
    if bits != 4:
        raise UnsupportedQuantization(f"GPTQ with {bits} bits: only 4-bit weights are supported")
    fmt = config.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise UnsupportedQuantization(f"GPTQ checkpoint_format {fmt!r}: only gptq and gptq_v2 are read")
    # sym / desc_act are not trusted: the loader reads zeros and g_idx from the tensors.
    return CheckpointQuant(GPTQ, group_size=config.get("group_size", 128), gptq_v1_zeros=fmt == "gptq")


def _parse_compressed_tensors(config: dict[str, Any]) -> CheckpointQuant:
    groups = list(config.get("config_groups", {}).values())
    if len(groups) != 1:
        raise UnsupportedQuantization(
            f"compressed-tensors with {len(groups)} config groups: one weight scheme for all experts is supported"
        )
    group = groups[0]
    fmt = group.get("format") or config.get("format")
    if fmt != PACK_QUANTIZED:
        raise UnsupportedQuantization(f"compressed-tensors format {fmt!r}: only {PACK_QUANTIZED!r} is read")
    if group.get("input_activations"):
        raise UnsupportedQuantization("compressed-tensors with quantized activations: only W4A16 is supported")
    weights = group.get("weights") or {}
    if weights.get("num_bits") != 4 or weights.get("type", "int") != "int":
        raise UnsupportedQuantization(
            f"compressed-tensors weights {weights.get('type')}{weights.get('num_bits')}: only int4 is supported"
        )
    if weights.get("dynamic"):
        raise UnsupportedQuantization("compressed-tensors dynamic weight quantization is not supported")
    strategy = weights.get("strategy")
    if strategy == "group":
        group_size = weights["group_size"]
    elif strategy == "channel":
        group_size = -1
    else:
        raise UnsupportedQuantization(
            f"compressed-tensors strategy {strategy!r}: only 'group' and 'channel' are supported"
        )
    return CheckpointQuant(COMPRESSED_TENSORS, group_size=group_size, ignore=tuple(config.get("ignore", ())))
