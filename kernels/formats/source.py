"""Where the loaders read tensors from: anything with `in` and `[]` by name."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from kernels.formats.config import FormatMismatch


class TensorSource(Protocol):
    """A read-only map from tensor names to tensors (a dict works)."""

    def __contains__(self, name: object) -> bool: ...

    def __getitem__(self, name: str) -> torch.Tensor: ...


class SafetensorsFiles:
    """Tensors of safetensors files, read lazily by name. The index comes from the checkpoint's
    reader (protos/checkpoint.py: `MoeCheckpoint.tensor_files()`), which owns the headers."""

    def __init__(self, file_of: Mapping[str, Path]) -> None:
        self._file_of = dict(file_of)

    def __contains__(self, name: object) -> bool:
        return name in self._file_of

    def __getitem__(self, name: str) -> torch.Tensor:
        with safe_open(self._file_of[name], framework="pt") as handle:
            return handle.get_tensor(name)


_MARKERS = (
    ("weight_packed", "compressed-tensors pack-quantized"),
    ("qweight", "GPTQ/AWQ (qweight)"),
    ("weight", "16-bit (weight)"),
)


def found_format(source: TensorSource, prefix: str) -> str:
    """Names the format whose tensors exist under `prefix`, for refusal messages."""
    for suffix, name in _MARKERS:
        if f"{prefix}.{suffix}" in source:
            return name
    return "no known weight tensors"


def require(source: TensorSource, prefix: str, suffixes: tuple[str, ...], expected: str) -> None:
    """Raises FormatMismatch unless every `prefix.suffix` exists."""
    missing = [s for s in suffixes if f"{prefix}.{s}" not in source]
    if missing:
        raise FormatMismatch(
            f"{prefix}: expected {expected} tensors ({', '.join(missing)} missing), "
            f"found {found_format(source, prefix)}"
        )
