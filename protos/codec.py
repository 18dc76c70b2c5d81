"""torch.Tensor <-> wire Tensor. The only code that touches tensor bytes."""
from __future__ import annotations

import math

import torch

from protos import expert_pb2 as pb

_TO_WIRE = {
    torch.float32: pb.FLOAT32,
    torch.float16: pb.FLOAT16,
    torch.bfloat16: pb.BFLOAT16,
    torch.float64: pb.FLOAT64,
    torch.int32: pb.INT32,
    torch.int64: pb.INT64,
}
_FROM_WIRE = {v: k for k, v in _TO_WIRE.items()}


class CodecError(ValueError):
    """A wire tensor whose dtype, shape or byte count is invalid."""


def wire_dtype(dtype: torch.dtype) -> int:
    try:
        return _TO_WIRE[dtype]
    except KeyError:
        raise CodecError(f"dtype {dtype} has no wire encoding") from None


def torch_dtype(wire: int) -> torch.dtype:
    try:
        return _FROM_WIRE[wire]
    except KeyError:
        raise CodecError(f"unknown wire dtype {pb.DType.Name(wire) if wire in pb.DType.values() else wire}") from None


def encode(t: torch.Tensor) -> pb.Tensor:
    """Serialize a CPU tensor as row-major little-endian bytes."""
    t = t.detach().to("cpu").contiguous()
    return pb.Tensor(
        dtype=wire_dtype(t.dtype),
        shape=list(t.shape),
        data=t.view(torch.uint8).numpy().tobytes() if t.numel() else b"",
    )


def decode(msg: pb.Tensor) -> torch.Tensor:
    """Deserialize, checking that the byte count matches dtype and shape."""
    dtype = torch_dtype(msg.dtype)
    shape = tuple(msg.shape)
    if any(d < 0 for d in shape):
        raise CodecError(f"negative dimension in shape {list(shape)}")
    expected = math.prod(shape) * dtype.itemsize
    if len(msg.data) != expected:
        raise CodecError(
            f"{torch_dtype(msg.dtype)} tensor of shape {list(shape)} needs {expected} bytes, got {len(msg.data)}"
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    # bytearray: torch.frombuffer needs a writable buffer to hand out a normal tensor.
    return torch.frombuffer(bytearray(msg.data), dtype=dtype).view(shape)
